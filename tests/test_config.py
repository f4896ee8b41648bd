import re

import pytest

from tidal.config import ConfigError, apply_overrides, config_from_dict, load_config


def test_defaults_have_the_keys_other_tooling_drives():
    cfg = config_from_dict({})
    assert cfg.mode == "periodic"
    assert min(cfg.trainer.iterations, cfg.rollout.workers, cfg.rollout.group_size, cfg.trainer.prompts_per_iteration) > 0
    assert cfg.rollout.engine == "hf" and isinstance(cfg.seed, int)


def test_unknown_key_is_named(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("trainer:\n  iteratons: 3\n")
    with pytest.raises(ConfigError, match=r"trainer\.iteratons: unknown key"):
        load_config(path)


def test_bad_value_is_named():
    with pytest.raises(ConfigError, match=r"rollout\.group_size"):
        config_from_dict({"rollout": {"group_size": 0}})
    with pytest.raises(ConfigError, match=r"mode"):
        config_from_dict({"mode": "eventually"})


def test_overrides_are_parsed_as_yaml(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("mode: sync\n")
    cfg = load_config(path, ["trainer.iterations=7", "rollout.deterministic=true", "mode=periodic"])
    assert cfg.trainer.iterations == 7 and cfg.rollout.deterministic is True and cfg.mode == "periodic"


def test_override_errors_name_the_override():
    with pytest.raises(ConfigError, match="key=value"):
        apply_overrides({}, ["trainer.iterations"])
    with pytest.raises(ConfigError, match="not a section"):
        apply_overrides({"mode": "sync"}, ["mode.x=1"])


def test_an_override_steps_into_a_list_the_config_gives_by_number():
    data = {"reward": {"functions": [{"name": "exact_match"}, {"name": "format", "weight": 0.1}]}}
    apply_overrides(data, ["reward.functions.1.weight=0.5", "reward.functions.0={name: format}"])
    assert data["reward"]["functions"] == [{"name": "format"}, {"name": "format", "weight": 0.5}]
    cases = [
        ("reward.functions.2.weight=1", "reward.functions has 2 item(s), numbered from 0"),
        ("reward.functions.first.weight=1", "reward.functions is a list: its items are numbered from 0, not named 'first'"),
        (
            "rollout.agent.tools.0=calc",
            "rollout.agent.tools is not in the config, so it has no item 0: set the whole list, e.g. --set 'rollout.agent.tools=[...]'",
        ),
    ]
    for override, message in cases:
        with pytest.raises(ConfigError, match=re.escape(message)):
            apply_overrides(data, [override])


def test_missing_and_malformed_files(tmp_path):
    with pytest.raises(ConfigError, match="not found"):
        load_config(tmp_path / "nope.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("a: [1, 2\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(bad)


def test_jsonl_task_requires_a_path():
    with pytest.raises(ConfigError, match="data.path is required"):
        config_from_dict({"data": {"task": "jsonl"}})


def test_nccl_weight_sync_without_vllm_workers_is_named():
    with pytest.raises(ConfigError, match=r"weight_sync 'nccl'.*rollout.engine 'vllm'"):
        config_from_dict({"rollout": {"vllm": {"weight_sync": "nccl"}}})
    with pytest.raises(ConfigError, match=r"mode 'periodic'"):
        config_from_dict({"mode": "sync", "rollout": {"engine": "vllm", "vllm": {"weight_sync": "nccl"}}})
    assert config_from_dict({"mode": "sync", "rollout": {"engine": "vllm"}}).rollout.engine == "vllm"


@pytest.mark.parametrize("platform", ["ascend", "cpu"])
def test_nccl_weight_sync_on_a_platform_without_cuda_is_named(platform):
    nccl = {"engine": "vllm", "vllm": {"weight_sync": "nccl", "platform": platform}}
    with pytest.raises(ConfigError, match=rf"needs CUDA GPUs but rollout.vllm.platform is '{platform}'.*'store'"):
        config_from_dict({"rollout": nccl})
    store = {"engine": "vllm", "vllm": {"weight_sync": "store", "platform": platform}}
    assert config_from_dict({"rollout": store}).rollout.vllm.platform == platform


def test_relative_data_paths_in_a_config_file_are_relative_to_the_file(tmp_path, monkeypatch):
    from tidal.config import dump_config, load_config

    folder = tmp_path / "examples"
    folder.mkdir()
    config = folder / "c.yaml"
    config.write_text("data: {task: jsonl, path: data/train.jsonl, eval_path: /abs/test.jsonl}\n")
    monkeypatch.chdir(tmp_path)
    cfg = load_config(config)
    assert cfg.data.path == str(folder / "data" / "train.jsonl")
    assert cfg.data.eval_path == "/abs/test.jsonl"
    overridden = load_config(config, ["data.path=mine.jsonl"])
    assert overridden.data.path == str(tmp_path / "mine.jsonl")  # an override: the working directory's
    # dumped (run_dir/config.yaml) and reloaded from another folder by a role: the same absolute paths
    staged = tmp_path / "run" / "config.yaml"
    staged.parent.mkdir()
    staged.write_text(dump_config(overridden))
    assert load_config(staged).data.path == overridden.data.path
    assert load_config(config, base_dir=tmp_path / "elsewhere").data.path == str(tmp_path / "elsewhere" / "data" / "train.jsonl")


def test_the_pipeline_stages_an_image_config_with_its_data_paths_from_the_image(tmp_path):
    """kube prepare step: config_path is a file in the component image (examples/gsm8k.yaml); the
    staged run config must point at the image's data, not at the run directory's copy."""
    from pathlib import Path

    from tidal.config import load_config
    from tidal.kube.steps.records import StepRecords
    from tidal.kube.steps.staging import stage_config
    from tidal.rundir import RunDir

    example = Path(__file__).resolve().parents[1] / "examples" / "gsm8k.yaml"
    offline = [  # the hub is out of reach here: the built-in tiny model, with a context that fits GSM8K's prompts
        "model.name_or_path=null",
        "model.tiny.max_position_embeddings=4096",
        "data.chat_template=false",
        "rollout.engine=hf",
    ]
    run = RunDir(tmp_path)
    staged = load_config(stage_config(run, "", str(example), ["trainer.iterations=2", *offline]))
    assert staged.data.path == str(example.parent / "data" / "gsm8k" / "train.jsonl")
    assert staged.trainer.iterations == 2
    assert StepRecords(run).submitted_config.read_text() == example.read_text()


def test_training_changes_name_what_would_change_training_and_nothing_else(tiny_config_dict):
    import copy

    from tidal.config import training_changes

    old = config_from_dict(copy.deepcopy(tiny_config_dict))
    new = copy.deepcopy(tiny_config_dict)
    new["trainer"].update({"iterations": 50, "lr": 0.01, "group_timeout_seconds": 5})
    new["rollout"].update({"workers": 3, "group_size": 8})
    new["eval"]["enabled"] = False
    new["tracking"] = {"experiment": "other"}
    new["transport"] = {"ack_wait_seconds": 2}
    new["seed"] = 1
    assert training_changes(old, config_from_dict(new)) == ["seed (0 -> 1)", "rollout.group_size (4 -> 8)", "trainer.lr (0.001 -> 0.01)"]
    assert training_changes(old, old) == []


def test_a_rule_over_a_block_is_one_short_line_without_the_block_echoed():
    # a rule of the whole config, of a section, and a plain ValueError's reason: each names its keys itself
    cases = [
        ({"mode": "sync", "trainer": {"ranks": 2}}, "trainer.ranks > 1 needs mode 'periodic' or 'bounded'"),
        ({"eval": {"samples_per_prompt": 2, "k": [1, 4]}}, "eval.k [4] must each be between 1 and eval.samples_per_prompt (2)"),
        ({"data": {"task": "jsonl"}}, "data.path is required when data.task is 'jsonl'"),
        ({"rollout": {"tools": ["calc"]}}, "rollout.tools: only for multi-turn rollouts, which are rollout.agent now"),
        (
            {"reward": {"functions": [{"name": "exact_match", "url": "http://x"}]}},
            "reward.functions.0.url: only for type 'reward_model' or 'judge', not 'function'",
        ),
        ({"reward": {"functions": [{"type": "rm", "url": "http://x"}]}}, "reward.functions.0: type must be 'function', 'reward_model' or 'judge'"),
    ]
    for data, reason in cases:
        with pytest.raises(ConfigError) as err:
            config_from_dict(data, "c.yaml")
        message = str(err.value)
        assert message.startswith(f"invalid config (c.yaml): {reason}"), message
        assert "\n" not in message and "got {" not in message and "Value error" not in message and "<root>" not in message
        assert len(message) < 300, message


def test_a_bad_value_is_shown_cut_short():
    with pytest.raises(ConfigError, match=r"^invalid config \(<dict>\): mode: Input should be .* \(got 'x{76}\.\.\.\)$"):
        config_from_dict({"mode": "x" * 500})
    with pytest.raises(ConfigError, match=r"rollout\.workers: min \(3\) is above max \(1\)$"):
        config_from_dict({"rollout": {"workers": {"min": 3, "max": 1}}})
