import json

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
