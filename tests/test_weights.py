import json
from pathlib import Path

import pytest
import torch

from tidal.weights import CorruptSnapshotError, WeightStore


def test_publish_and_load_roundtrip_with_manifest(tmp_path):
    store = WeightStore(tmp_path / "weights")
    sd = {"a": torch.randn(3, 4), "b": torch.arange(5)}
    path = store.publish(7, sd)
    assert path.name == "v000007" and store.latest_version() == 7
    manifest = json.loads((path / "manifest.json").read_text())
    assert manifest["version"] == 7 and len(manifest["files"]["model.safetensors"]) == 64
    loaded = store.load(7)
    assert torch.equal(loaded["a"], sd["a"]) and torch.equal(loaded["b"], sd["b"])
    assert not [p for p in (tmp_path / "weights").iterdir() if p.name.startswith(".tmp")]


def test_tied_tensors_are_stored_once(tmp_path):
    w = torch.randn(4, 4)
    store = WeightStore(tmp_path)
    loaded = store.load(store.publish(0, {"embed": w, "lm_head": w}))
    assert list(loaded) == ["embed"]


def test_corrupt_snapshot_is_refused(tmp_path):
    store = WeightStore(tmp_path)
    path = store.publish(1, {"a": torch.zeros(100)})
    blob = bytearray((path / "model.safetensors").read_bytes())
    blob[-3] ^= 0xFF
    (path / "model.safetensors").write_bytes(bytes(blob))
    with pytest.raises(CorruptSnapshotError, match="sha256 .* does not match manifest"):
        store.load(1)
    (path / "manifest.json").unlink()
    with pytest.raises(CorruptSnapshotError, match="no manifest.json"):
        store.load(1)


def flip_a_byte(path: Path) -> None:
    blob = bytearray((path / "model.safetensors").read_bytes())
    blob[-3] ^= 0xFF
    (path / "model.safetensors").write_bytes(bytes(blob))


def test_a_corrupt_snapshot_is_rewritten_from_the_weights_it_held_and_an_intact_one_is_left(tmp_path):
    store = WeightStore(tmp_path)
    sd = {"a": torch.randn(100), "b": torch.arange(5)}
    path = store.publish(1, sd)
    assert store.repair(1, sd) is False  # verifies: nothing to do
    flip_a_byte(path)
    assert store.repair(1, sd) is True
    assert torch.equal(store.load(1)["a"], sd["a"])
    # another trainer process (a restart) has no record of what it wrote: the manifest says
    flip_a_byte(path)
    assert WeightStore(tmp_path).repair(1, sd) is True and torch.equal(store.load(1)["a"], sd["a"])


def test_a_corrupt_snapshot_is_not_rewritten_from_other_weights(tmp_path):
    store = WeightStore(tmp_path)
    path = store.publish(1, {"a": torch.zeros(100)})
    flip_a_byte(path)
    with pytest.raises(CorruptSnapshotError, match=r"sha256 .* cannot be rewritten: the trainer's weights are no longer v1"):
        store.repair(1, {"a": torch.ones(100)})
    with pytest.raises(CorruptSnapshotError):
        store.load(1)  # still the corrupt file: nothing was replaced
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".tmp")]


# ---------------------------------------------------------------- retention (weights.keep_last / keep_every)


def publish_versions(store: WeightStore, versions) -> None:
    for v in versions:
        store.publish(v, {"a": torch.full((4,), float(v))})


def test_prune_keeps_the_newest_the_milestones_the_protected_and_latest(tmp_path):
    store = WeightStore(tmp_path / "weights")
    publish_versions(store, range(10))
    store.point_latest(6)  # e.g. weight_sync pointed `latest` at the round's snapshot
    deleted = store.prune(keep_last=2, keep_every=4, protected={1})
    assert store.versions() == [0, 1, 4, 6, 8, 9]  # newest 2, multiples of 4, protected 1, latest 6
    assert deleted == [2, 3, 5, 7]
    assert sorted(p.name for p in store.root.iterdir()) == ["latest"] + [f"v{v:06d}" for v in (0, 1, 4, 6, 8, 9)]
    for v in store.versions():  # what is left is whole
        assert store.load(v)["a"][0].item() == float(v)
    assert store.prune(keep_last=2, keep_every=4, protected={1}) == []  # idempotent


def test_prune_without_keep_last_keeps_everything(tmp_path):
    store = WeightStore(tmp_path / "weights")
    publish_versions(store, range(4))
    assert store.prune(keep_last=None, keep_every=None, protected=set()) == [] and store.versions() == [0, 1, 2, 3]


def test_retention_never_deletes_what_a_worker_may_load_or_a_resume_needs(tmp_path):
    from tidal.config import TidalConfig
    from tidal.trainer.loop import prune_snapshots

    store = WeightStore(tmp_path / "weights")
    publish_versions(store, range(11))
    periodic = TidalConfig.model_validate({"weights": {"keep_last": 1}, "eval": {"every": None}})
    # v10 just published (workers switch to it; a slow one may still be loading v9); the checkpoint says v7
    prune_snapshots(periodic, store, published=10, checkpoint=7)
    assert store.versions() == [7, 9, 10]
    bounded = TidalConfig.model_validate({"mode": "bounded", "rollout": {"max_staleness": 2}, "weights": {"keep_last": 1}})
    publish_versions(store, range(11))
    prune_snapshots(bounded, store, published=10, checkpoint=10)
    assert store.versions() == [7, 8, 9, 10]  # bounded: workers generate up to max_staleness versions behind
    with_curve = TidalConfig.model_validate({"weights": {"keep_last": 1}, "eval": {"every": 4}})
    publish_versions(store, range(11))
    prune_snapshots(with_curve, store, published=10, checkpoint=10)
    assert store.versions() == [8, 9, 10]  # the held-out curve's next version (eval.every) stays


def test_retention_settings_are_validated():
    from tidal.config import ConfigError, load_config

    with pytest.raises(ConfigError, match="weights.keep_last"):
        load_config(None, ["weights.keep_last=0"])
    with pytest.raises(ConfigError, match="weights.kep_last"):
        load_config(None, ["weights.kep_last=3"])
    with pytest.raises(ConfigError, match="stream_max_mb"):
        load_config(None, ["transport.stream_max_mb=8"])  # under 4 x max_payload_mb (8)
    assert load_config(None, ["weights.keep_last=null"]).weights.keep_last is None


def test_with_the_run_key_a_planted_snapshot_is_refused_even_with_a_consistent_manifest(tmp_path, monkeypatch):
    """the sha256s prove integrity, the HMAC under the run's key proves the run's trainer wrote it."""
    from tidal.weights import SIGNING_KEY_ENV, sha256_of

    monkeypatch.setenv(SIGNING_KEY_ENV, "run-secret")
    store = WeightStore(tmp_path)
    path = store.publish(1, {"a": torch.zeros(10)})
    assert torch.equal(store.load(1)["a"], torch.zeros(10))  # signed and checked
    assert "hmac" in json.loads((path / "manifest.json").read_text())

    # an attacker with write access to the store swaps the weights and recomputes the manifest
    from safetensors.torch import save_file

    save_file({"a": torch.full((10,), 7.0)}, str(path / "model.safetensors"))
    manifest = json.loads((path / "manifest.json").read_text())
    manifest["files"]["model.safetensors"] = sha256_of(path / "model.safetensors")
    (path / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(CorruptSnapshotError, match=r"has a signature that does not match with this run's key \(TIDAL_WEIGHTS_KEY\)"):
        store.load(1)
    del manifest["hmac"]
    (path / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(CorruptSnapshotError, match=r"is not signed with this run's key"):
        store.load(1)
    monkeypatch.setenv(SIGNING_KEY_ENV, "another-run")
    good = store.publish(2, {"a": torch.zeros(10)})
    monkeypatch.setenv(SIGNING_KEY_ENV, "run-secret")
    with pytest.raises(CorruptSnapshotError, match="signature that does not match"):
        store.load(good)


def test_the_run_key_is_made_once_private_and_kept(tmp_path):
    import stat

    from tidal.rundir import run_signing_key

    key = run_signing_key(tmp_path)
    assert len(key) > 32 and run_signing_key(tmp_path) == key
    assert stat.S_IMODE((tmp_path / "weights-key").stat().st_mode) == 0o600
