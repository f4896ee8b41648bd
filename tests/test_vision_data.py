"""Images in data rows and on the wire, and the tiny vision-language model saved and loaded back locally."""

from __future__ import annotations

import base64
import json
import re

import numpy as np
import pytest

from tidal import images as image_limits
from tidal.data import Dataset, DatasetError, Problem, read_jsonl_problems
from tidal.demo.vision import save_tiny_vlm, write_count_task
from tidal.images import ImageInputs
from tidal.protocol import Group, GroupLimits, ProtocolError, Sample, WorkItem, decode_group, decode_work_item, pack, unpack
from tidal.trainer.iteration_plan import work_items


@pytest.fixture(scope="module")
def task(tmp_path_factory):
    return write_count_task(tmp_path_factory.mktemp("count"), rows=6, seed=3)


def test_rows_carry_their_images_as_checked_bytes(task):
    problems = read_jsonl_problems(task)
    rows = [json.loads(line) for line in task.read_text().splitlines()]
    assert [p.answer for p in problems] == [r["answer"] for r in rows]
    for problem, row in zip(problems, rows, strict=True):
        assert problem.images == ((task.parent / row["images"][0]).read_bytes(),)
        assert problem.images[0].startswith(b"\x89PNG")


def write_rows(path, rows) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def test_an_image_may_be_inline_base64(task, tmp_path):
    data = (task.parent / "images" / "00000.png").read_bytes()
    path = write_rows(tmp_path / "d.jsonl", [{"question": "q", "answer": "1", "images": [{"bytes": base64.b64encode(data).decode()}]}])
    assert read_jsonl_problems(path)[0].images == (data,)


def test_text_rows_have_no_images(tmp_path):
    assert read_jsonl_problems(write_rows(tmp_path / "d.jsonl", [{"question": "q", "answer": "1"}]))[0].images == ()


@pytest.mark.parametrize(
    ("entry", "says"),
    [
        ("images/missing.png", "image file not found"),
        ("notes.txt", "not a readable image"),
        ({"bytes": "%%%"}, "not base64"),
        (7, "expected a file path"),
    ],
)
def test_bad_images_are_one_line_errors_naming_the_row(task, tmp_path, entry, says):
    (task.parent / "notes.txt").write_text("not an image")
    path = write_rows(task.parent / "bad.jsonl", [{"question": "q", "answer": "1", "images": [entry]}])
    with pytest.raises(DatasetError, match=says) as err:
        read_jsonl_problems(path)
    assert f"{path}:1: images[0]" in str(err.value) and "\n" not in str(err.value)


def test_too_large_images_are_refused(task, monkeypatch):
    path = write_rows(task.parent / "big.jsonl", [{"question": "q", "answer": "1", "images": ["images/00000.png"]}])
    monkeypatch.setattr(image_limits, "MAX_IMAGE_PIXELS", 56 * 56 - 1)
    with pytest.raises(DatasetError, match=r"56x56 pixels, more than the 3135-pixel limit"):
        read_jsonl_problems(path)
    monkeypatch.setattr(image_limits, "MAX_IMAGE_BYTES", 10)
    with pytest.raises(DatasetError, match="more than the 10-byte limit"):
        read_jsonl_problems(path)


# --- on the wire -------------------------------------------------------------------------------


def image_inputs(patches: int = 16) -> ImageInputs:
    rng = np.random.default_rng(0)
    return ImageInputs(rng.standard_normal((patches, 1176)).astype(np.float32), np.array([[1, 4, patches // 4]]))


def group(images: ImageInputs | None = None) -> Group:
    samples = [Sample(np.array([5, 6], dtype=np.int32), np.array([-0.5, -0.25], dtype=np.float32), r) for r in (0.0, 1.0)]
    return Group(1, 2, 1, "w0", np.array([1, 2, 3], dtype=np.int32), samples, images=images)


def test_text_messages_do_not_name_images():
    assert "images" not in unpack(pack(group()))
    assert "images" not in unpack(pack(WorkItem(0, 1, "p", "a")))
    assert decode_group(pack(group())).images is None


def test_work_items_carry_a_prompts_image_files(task):
    problems = read_jsonl_problems(task)
    [item] = work_items(4, problems[:1])
    decoded = decode_work_item(pack(item))
    assert decoded.images == list(problems[0].images)
    with pytest.raises(ProtocolError, match="work item.images: expected a list of 1 to 16 encoded images"):
        decode_work_item(pack({"iteration": 0, "prompt_id": 1, "prompt": "p", "answer": "a", "images": ["not bytes"]}))


def test_a_group_carries_its_processed_images_once():
    sent = image_inputs()
    wire = pack(group(sent))
    received = decode_group(wire, GroupLimits(max_bytes=len(wire)))
    np.testing.assert_array_equal(received.images.pixel_values, sent.pixel_values)
    np.testing.assert_array_equal(received.images.image_grid_thw, sent.image_grid_thw)
    assert len(pack(group())) + sent.pixel_values.nbytes < len(wire) < len(pack(group())) + 2 * sent.pixel_values.nbytes


@pytest.mark.parametrize(
    ("images", "says"),
    [
        ({"pixel_values": np.zeros((15, 1176), np.float32), "image_grid_thw": np.array([[1, 4, 4]])}, "15 patch rows for a grid of 16"),
        ({"pixel_values": np.full((16, 1176), np.nan, np.float32), "image_grid_thw": np.array([[1, 4, 4]])}, "pixel_values: not finite"),
        ({"pixel_values": np.zeros((16, 1176), np.float32), "image_grid_thw": np.array([1, 4, 4])}, r"an \[images, 3\] integer array"),
        ({"pixel_values": np.zeros((0, 1176), np.float32), "image_grid_thw": np.array([[1, 0, 4]])}, "positive sizes"),
        ("pixels", "expected a map"),
    ],
)
def test_bad_images_in_a_group_are_protocol_errors(images, says):
    data = unpack(pack(group()))
    data["images"] = images
    with pytest.raises(ProtocolError, match=f"group 1/2.images.*{says}"):
        decode_group(pack(data))


def test_an_oversized_group_with_images_is_refused():
    wire = pack(group(image_inputs()))
    with pytest.raises(ProtocolError, match="exceeds"):
        decode_group(wire, GroupLimits(max_bytes=len(wire) - 1))


# --- the tiny model and its processor, saved and loaded back -----------------------------------


def test_the_tiny_vlm_and_its_processor_load_back_from_one_directory(tmp_path, task):
    import torch
    from transformers import AutoModelForImageTextToText

    from tidal.model.vision import is_vision_model, load_processor

    directory = save_tiny_vlm(tmp_path / "vlm")
    processor = load_processor(directory)
    model = AutoModelForImageTextToText.from_pretrained(str(directory))
    assert is_vision_model(model.config)
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "how many red squares?"}]}]
    ids = processor.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
    image = read_jsonl_problems(task)[0].images[0]
    prompt, inputs = processor.encode(list(ids), [image])
    assert inputs.image_grid_thw.tolist() == [[1, 4, 4]] and inputs.pixel_values.shape == (16, 1176)  # 56x56: 16 patches
    assert prompt.count(processor.image_token_id) == 4 == inputs.tokens(processor.merge_size)
    assert processor.tokenizer.decode(prompt[-5:]) == "?\n<a>"
    with pytest.raises(ValueError, match="1 image tokens for 2 images"):
        processor.encode(list(ids), [image, image])
    x = torch.tensor([prompt])
    out = model.generate(
        input_ids=x,
        pixel_values=torch.from_numpy(inputs.pixel_values),
        image_grid_thw=torch.from_numpy(inputs.image_grid_thw),
        mm_token_type_ids=(x == processor.image_token_id).long(),
        max_new_tokens=3,
        do_sample=False,
    )
    assert out.shape == (1, len(prompt) + 3)


def test_a_multi_turn_run_with_images_needs_a_template_that_renders_them(task, tmp_path):
    from tidal.config import config_from_dict
    from tidal.demo.tiny import TOOL_CHAT_TEMPLATE
    from tidal.demo.vision import build_vision_tokenizer
    from tidal.preflight import check_agent_renders_images

    dataset = Dataset(read_jsonl_problems(task), [])
    agent = {"env": "tools", "tools": ["calc"], "max_turns": 3}
    tiny_vlm = config_from_dict({"model": {"tiny": {"arch": "qwen2_vl"}}, "rollout": {"agent": agent}})
    check_agent_renders_images(tiny_vlm, dataset)  # the tiny VLM's template renders image parts
    partial = config_from_dict({"mode": "bounded", "model": {"tiny": {"arch": "qwen2_vl"}}, "rollout": {"agent": agent, "partial": True}})
    with pytest.raises(DatasetError, match=r"data\.jsonl:1: the row has images, and rollout\.partial does not yet continue a multi-turn"):
        check_agent_renders_images(partial, dataset)
    for name, template, refused in (
        ("drops", "{% for m in messages %}{{ m.content if m.content is string else m.content[-1].text }}{% endfor %}", "renders 0 <|image_pad|>"),
        ("text", TOOL_CHAT_TEMPLATE, "cannot render the row's images in a user message"),  # '<u>' + a list of parts
    ):
        tokenizer = build_vision_tokenizer()
        tokenizer.chat_template = template
        tokenizer.save_pretrained(tmp_path / name)
        cfg = config_from_dict({"model": {"name_or_path": str(tmp_path / name)}, "rollout": {"agent": agent}})
        check_agent_renders_images(cfg.model_copy(update={"rollout": cfg.rollout.model_copy(update={"agent": None})}), dataset)  # single-turn
        with pytest.raises(DatasetError, match=r"data\.jsonl:1: .*" + re.escape(refused)):
            check_agent_renders_images(cfg, dataset)


def test_a_rows_images_count_toward_its_work_items_size(task):
    from tidal.preflight import check_row_sizes

    problem = read_jsonl_problems(task)[0]
    heavy = Problem(problem.id, problem.prompt, problem.answer, problem.origin, (b"\0" * (2 << 20),))
    check_row_sizes(Dataset([problem], []), max_payload_mb=1)
    with pytest.raises(DatasetError, match=r"data\.jsonl:1: the row is 2\.0 MB; a work item must fit in transport\.max_payload_mb \(1 MB\)"):
        check_row_sizes(Dataset([heavy], []), max_payload_mb=1)
