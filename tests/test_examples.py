"""The example configs a user copies: they load from any directory, their data is there, and the
GSM8K one (GPU, hub model: it cannot run here) renders the prompts its instruct model expects."""

from pathlib import Path

import pytest

from tidal.config import load_config
from tidal.data import load_dataset, render_prompt
from tidal.rewards import RewardScorer

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


@pytest.mark.parametrize("name", sorted(p.name for p in EXAMPLES.glob("*.yaml")))
def test_every_example_loads_from_another_directory_with_its_data(name, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    cfg = load_config(EXAMPLES / name)
    dataset = load_dataset(cfg.data, cfg.seed)
    assert len(dataset.train) >= cfg.trainer.prompts_per_iteration
    assert dataset.eval
    if cfg.data.task == "jsonl":
        assert Path(cfg.data.path).is_file() and (Path(cfg.data.path).parent / "LICENSE").is_file()


def test_gsm8k_example_uses_the_full_splits_and_an_instruction_the_reward_understands():
    cfg = load_config(EXAMPLES / "gsm8k.yaml")
    dataset = load_dataset(cfg.data, cfg.seed)
    assert (len(dataset.train), len(dataset.eval)) == (7473, 1319)  # eval_path given: no split of train
    (message,) = render_prompt(dataset.train[0].prompt, cfg.data)
    assert message["role"] == "user" and message["content"].endswith('final answer after "####".')
    scorer = RewardScorer.from_config(cfg.reward)
    answer = dataset.train[0].answer
    assert scorer.score(f"Step one.\n#### {answer}", answer)[0] == pytest.approx(1.1)  # correct + format
    assert scorer.score("Step one.\n#### 0.5", answer)[0] == pytest.approx(0.1)
    assert "math_verify" in scorer.score(f"#### {answer}", answer)[1]  # the math-verify reward, not the regex


def test_a_model_that_cannot_be_loaded_is_named(tmp_path):
    from tidal.model.loading import ModelLoadError, load_model_and_tokenizer

    # (a hub id would be tried against the hub, with retries: offline, that is what a user sees too)
    with pytest.raises(ModelLoadError, match=r"cannot load the tokenizer of '/nonexistent/model' \(model.name_or_path\)"):
        load_model_and_tokenizer("/nonexistent/model")
    (tmp_path / "tokenizer_config.json").write_text("{}")  # a folder that is not a model
    with pytest.raises(ModelLoadError, match=rf"of '{tmp_path}'"):
        load_model_and_tokenizer(tmp_path)
