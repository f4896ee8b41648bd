"""Held-out evaluation: pass@k (unbiased), maj@k, and the curve evaluated while training runs."""

import json
import math

import pytest

from tests.conftest import run_cli
from tidal.evaluate import curve_targets, majority_correct, pass_at_k


def test_pass_at_k_is_the_unbiased_estimator():
    assert pass_at_k(8, 0, 4) == 0.0 and pass_at_k(8, 8, 1) == 1.0
    assert pass_at_k(8, 2, 1) == pytest.approx(2 / 8)
    assert pass_at_k(8, 2, 4) == pytest.approx(1 - math.comb(6, 4) / math.comb(8, 4))  # = 1 - 15/70
    assert pass_at_k(4, 3, 2) == 1.0  # fewer wrong samples than k: always a right one among any k
    with pytest.raises(ValueError, match="pass@5 needs at least 5 samples"):
        pass_at_k(4, 1, 5)


def test_majority_vote_counts_answers_not_samples_and_ignores_missing_ones():
    assert majority_correct(["12", "12", "7"], "12") and not majority_correct(["7", "7", "12"], "12")
    assert majority_correct([None, None, "12"], "12")  # no answer never wins
    assert majority_correct(["12", "7"], "12") and not majority_correct(["7", "12"], "12")  # tie: first seen
    assert not majority_correct([None], "12")


def test_the_curve_evaluates_the_newest_pending_version_and_always_the_last():
    assert curve_targets(latest=5, every=2, final=9, done=set()) == [4, 2, 0]
    assert curve_targets(latest=9, every=2, final=9, done={0, 2, 4}) == [9, 8, 6]
    assert curve_targets(latest=3, every=5, final=3, done={0}) == [3]


def test_the_run_logs_a_held_out_curve_to_mlflow_while_training(tmp_path, write_config):
    from mlflow.tracking import MlflowClient

    config = write_config({"eval.every": 1, "eval.k": [1, 2, 4], "eval.samples_per_prompt": 4})
    proc = run_cli("run", str(config), "--run-dir", str(tmp_path / "run"), "--no-progress")
    assert proc.returncode == 0, proc.stderr[-3000:]
    run_dir = tmp_path / "run"
    points = [json.loads(line) for line in (run_dir / "eval.jsonl").read_text().splitlines()]
    versions = [p["version"] for p in points]
    assert versions == sorted(versions) and versions[-1] == 3  # in order, ending at the final weights
    summary = json.loads((run_dir / "summary.json").read_text())
    client = MlflowClient(tracking_uri=f"sqlite:///{run_dir / 'mlflow.db'}")
    for name in ("eval/accuracy", "eval/sampled_accuracy", "eval/pass_at_4", "eval/maj_at_2"):
        steps = sorted(m.step for m in client.get_metric_history(summary["mlflow_run_id"], name))
        assert steps == versions, name
    assert {"pass_at_4_before", "pass_at_4_after", "maj_at_1_after"} <= set(summary)
    assert "held-out curve" in proc.stdout and "pass@4" in proc.stdout


def test_eval_k_above_the_samples_is_a_config_error():
    from tidal.config import ConfigError, config_from_dict

    with pytest.raises(ConfigError, match=r"eval.k \[8\] must each be between 1 and eval.samples_per_prompt \(4\)"):
        config_from_dict({"eval": {"k": [1, 8], "samples_per_prompt": 4}})


def test_a_follower_that_fell_behind_skips_a_snapshot_weight_retention_deleted(tmp_path, monkeypatch):
    """eval.every=2: the follower's next target is v2, which weights.keep_last deleted before it got there;
    it skips it and goes on to the final version instead of failing the run's held-out curve."""
    import torch

    from tidal import evaluate
    from tidal.config import TidalConfig
    from tidal.weights import WeightStore

    store = WeightStore(tmp_path / "weights")
    store.publish(3, {"a": torch.zeros(2)})  # v0..v2 were pruned: v2, the curve's next target, is gone
    cfg = TidalConfig.model_validate({"trainer": {"iterations": 4}, "eval": {"every": 2}})
    evaluated = []

    class Engine:
        def shutdown(self):
            pass

    def snapshot_scores(cfg, base_model, problems, path, engine, tokenizer):
        if not path.is_dir():
            store.publish(4, {"a": torch.ones(2)})  # training went on meanwhile
            raise FileNotFoundError(path)
        evaluated.append(path.name)
        return {"accuracy": 0.5}

    monkeypatch.setattr(evaluate, "load_tokenizer", lambda path: object())  # no model "base": what the stand-ins get
    monkeypatch.setattr(evaluate, "open_engine", lambda *a, **k: Engine())
    monkeypatch.setattr(evaluate, "evaluate_snapshot", snapshot_scores)
    records = evaluate.follow_run(cfg, tmp_path, "base", [], lambda metrics, step: None, poll_seconds=0.01)
    assert evaluated == ["v000004"] and [r["version"] for r in records] == [4]


def test_tidal_eval_of_no_missing_corrupt_or_not_the_trainers_snapshot_is_one_line(tmp_path, write_config):
    import json

    import torch

    from tidal.run_keys import run_key_pair
    from tidal.weights import WeightStore
    from tidal.weights.signing import new_key_pair

    run = tmp_path / "run"
    run.mkdir()
    (run / "run.json").write_text(json.dumps({"run_id": "r", "base_model": str(tmp_path / "base"), "tracking_uri": "", "mlflow_run_id": ""}))
    config = str(write_config())
    private, _ = run_key_pair(run)
    corrupt = WeightStore(tmp_path / "other", signing_key=private).publish(1, {"a": torch.zeros(2)})
    (corrupt / "model.safetensors").write_bytes(b"not the tensors")
    # consistent sha256s, but not the run's trainer's: another run's key, and none
    other_run = WeightStore(tmp_path / "other-run", signing_key=new_key_pair()[0]).publish(1, {"a": torch.zeros(2)})
    unsigned = WeightStore(tmp_path / "unsigned").publish(1, {"a": torch.zeros(2)})
    for weights, expected in [
        ([], "holds no weight snapshot: the run has not published any version"),
        (["--weights", str(tmp_path / "nope")], "no such snapshot directory"),
        (["--weights", str(corrupt)], "does not match manifest"),
        (["--weights", str(other_run)], f"snapshot {other_run}: its manifest is signed with ed25519 key"),
        (["--weights", str(unsigned)], f"snapshot {unsigned}: its manifest is not signed: not written by this run's trainer; not evaluated"),
    ]:
        proc = run_cli("eval", config, "--run-dir", str(run), *weights)
        assert proc.returncode == 2, proc.stderr[-3000:]
        assert proc.stderr.count("\n") == 1 and proc.stderr.startswith("tidal: error: ") and expected in proc.stderr, proc.stderr[-3000:]
