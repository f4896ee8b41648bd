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


def forge(path: Path, tensors: dict) -> dict:
    """What someone with write access to the store but not the trainer's private key can do: swap the weights
    and recompute the manifest's sha256s (it stays consistent)."""
    from safetensors.torch import save_file

    from tidal.weights import sha256_of

    save_file(tensors, str(path / "model.safetensors"))
    manifest = json.loads((path / "manifest.json").read_text())
    manifest["files"]["model.safetensors"] = sha256_of(path / "model.safetensors")
    (path / "manifest.json").write_text(json.dumps(manifest))
    return manifest


def test_a_snapshot_signed_with_anything_but_the_trainers_private_key_is_refused_by_the_workers_loader(tmp_path):
    """the sha256s prove integrity, the Ed25519 signature that only the trainer's private key makes proves the
    run's trainer wrote it; a worker holds the public key, which checks but cannot sign."""
    from tidal.weights import load_verified_with_manifest
    from tidal.weights.signing import manifest_signature, new_key_pair, trust_public_key

    private, public = new_key_pair()
    other_private, _ = new_key_pair()
    store = WeightStore(tmp_path, signing_key=private)
    path = store.publish(1, {"a": torch.zeros(10)})
    trust_public_key(public)  # what a rollout worker read from the run's public key file
    state, manifest = load_verified_with_manifest(path)  # the loader rollout workers use
    assert torch.equal(state["a"], torch.zeros(10))
    assert manifest["signature"]["alg"] == "ed25519" and manifest["signature"]["public_key"] == public

    def refused(match: str) -> None:
        with pytest.raises(CorruptSnapshotError, match=match) as err:
            load_verified_with_manifest(path)
        assert str(path) in str(err.value) and str(err.value).endswith("not written by this run's trainer")

    # the weights swapped under a valid signature: the signed manifest no longer matches
    signed = forge(path, {"a": torch.full((10,), 7.0)})
    refused("ed25519 signature does not verify with this run's trainer key")
    # no signature at all
    unsigned = {k: v for k, v in signed.items() if k != "signature"}
    (path / "manifest.json").write_text(json.dumps(unsigned))
    refused("its manifest is not signed")
    # signed with another run's private key, naming it, or claiming this run's public key
    other = {**unsigned, "signature": manifest_signature(unsigned, other_private)}
    (path / "manifest.json").write_text(json.dumps(other))
    refused(r"signed with ed25519 key [0-9a-f]{16}…, not this run's trainer key " + public[:16])
    other["signature"]["public_key"] = public
    (path / "manifest.json").write_text(json.dumps(other))
    refused("does not verify with this run's trainer key")
    # a worker knows only the public key: using it as a private key signs for another public key
    (path / "manifest.json").write_text(json.dumps({**unsigned, "signature": manifest_signature(unsigned, public)}))
    refused("not this run's trainer key")
    (path / "manifest.json").write_text(json.dumps({**unsigned, "signature": {"alg": "hmac-sha256", "value": "00"}}))
    refused("signature field is malformed")


def test_a_key_file_that_is_not_an_ed25519_key_is_named(tmp_path):
    from tidal.weights.signing import read_key_file, trust_public_key

    (tmp_path / "private").write_text("run-secret\n")
    with pytest.raises(ValueError, match=r"/private: not an ed25519 key \(64 hex digits expected, got 10 characters\)"):
        read_key_file(tmp_path / "private", private=True)
    (tmp_path / "public").write_text("ab" * 31)
    with pytest.raises(ValueError, match=r"/public: not an ed25519 key"):
        read_key_file(tmp_path / "public", private=False)
    with pytest.raises(ValueError, match="not an ed25519 key"):
        trust_public_key("ab" * 31)


def test_the_run_key_pair_is_made_once_private_and_kept(tmp_path):
    import stat

    from tidal.run_keys import run_key_pair
    from tidal.weights.signing import public_key_of

    private, public = run_key_pair(tmp_path)
    assert public_key_of(private) == public and run_key_pair(tmp_path) == (private, public)
    assert stat.S_IMODE((tmp_path / "weights-signing-key").stat().st_mode) == 0o600
    assert (tmp_path / "weights-public-key").read_text() == public
    (tmp_path / "weights-public-key").write_text("0" * 64)  # a changed public file is rewritten from the private key
    assert run_key_pair(tmp_path) == (private, public) and (tmp_path / "weights-public-key").read_text() == public


def test_an_hmac_era_run_directory_is_re_signed_on_its_next_launch_and_its_symmetric_key_deleted(tmp_path):
    """a run directory written before Ed25519 signing: versions whose HMAC verifies with RUN_DIR/weights-key are
    re-signed with the new private key; one whose HMAC does not is left as it was, and every loader refuses it."""
    from tidal.run_keys import run_key_pair, snapshot_keys, upgrade_hmac_run
    from tidal.weights import sha256_of, verify_snapshot
    from tidal.weights.signing import hmac_signature

    (tmp_path / "weights-key").write_text("t" + "ab" * 32)
    store = WeightStore(tmp_path / "weights")
    good, planted = store.publish(1, {"a": torch.zeros(3)}), store.publish(2, {"a": torch.ones(3)})
    for path, key in [(good, b"t" + b"ab" * 32), (planted, b"another-key")]:  # as the HMAC-era trainer wrote them
        manifest = json.loads((path / "manifest.json").read_text())
        (path / "manifest.json").write_text(json.dumps({**manifest, "hmac": hmac_signature(manifest, key)}))
    assert snapshot_keys(tmp_path) == {"hmac_key": b"t" + b"ab" * 32}  # eval and export before any relaunch
    verify_snapshot(good, **snapshot_keys(tmp_path))
    with pytest.raises(CorruptSnapshotError, match="HMAC-SHA256 does not match the run's weights-key"):
        verify_snapshot(planted, **snapshot_keys(tmp_path))

    private, public = run_key_pair(tmp_path)
    assert upgrade_hmac_run(tmp_path, tmp_path / "weights", private) == [str(planted)]
    assert not (tmp_path / "weights-key").exists()
    resigned = verify_snapshot(good, public)
    assert "hmac" not in resigned and resigned["files"]["model.safetensors"] == sha256_of(good / "model.safetensors")
    with pytest.raises(CorruptSnapshotError, match="only an HMAC-SHA256 signature from before Ed25519 signing"):
        verify_snapshot(planted, public)
    assert snapshot_keys(tmp_path) == {"public_key": public}
    assert upgrade_hmac_run(tmp_path, tmp_path / "weights", private) == []  # nothing left to upgrade


def test_a_clusters_key_pair_is_written_once_and_the_private_key_is_0600(tmp_path):
    import stat
    import subprocess
    import sys

    from tidal.weights.signing import public_key_of

    out = subprocess.run([sys.executable, "-m", "tidal.weights.keygen", str(tmp_path / "keys")], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    private = (tmp_path / "keys" / "private-key").read_text()
    assert stat.S_IMODE((tmp_path / "keys" / "private-key").stat().st_mode) == 0o600
    assert public_key_of(private) == (tmp_path / "keys" / "public-key").read_text()
    again = subprocess.run([sys.executable, "-m", "tidal.weights.keygen", str(tmp_path / "keys")], capture_output=True, text=True)
    assert again.returncode == 2 and "already exists" in again.stderr and (tmp_path / "keys" / "private-key").read_text() == private


def test_the_launcher_upgrades_an_hmac_era_run_before_any_role_and_keeps_the_private_key_out_of_its_environment(tmp_path):
    """what `tidal run` does first on a run directory: its key pair (made once, in the run directory's key files),
    HMAC-era versions re-signed, the public key trusted by the launcher's own checks, the private key returned for
    sync mode's trainer alone; nothing of either in the environment its children inherit."""
    import os

    from tidal.local import run_signatures
    from tidal.rundir import RunDir
    from tidal.weights import verify_snapshot
    from tidal.weights.signing import hmac_signature, new_key_pair, public_key_of, trusted_public_key

    before = dict(os.environ)
    (tmp_path / "weights-key").write_text("old-key")
    path = WeightStore(tmp_path / "weights", signing_key=new_key_pair()[0]).publish(1, {"a": torch.zeros(3)})
    manifest = {k: v for k, v in json.loads((path / "manifest.json").read_text()).items() if k != "signature"}  # as an HMAC-era trainer wrote it
    (path / "manifest.json").write_text(json.dumps({**manifest, "hmac": hmac_signature(manifest, b"old-key")}))

    private = run_signatures(RunDir(tmp_path))
    assert dict(os.environ) == before and trusted_public_key() == public_key_of(private)
    assert (tmp_path / "weights-signing-key").read_text() == private and not (tmp_path / "weights-key").exists()
    assert (tmp_path / "weights-public-key").read_text() == public_key_of(private)
    assert verify_snapshot(path)["signature"]["public_key"] == public_key_of(private)  # checked with the trusted key
    assert run_signatures(RunDir(tmp_path)) == private  # a resume signs with the same key


def test_each_role_reads_the_key_it_needs_from_a_file_and_a_named_file_must_exist(tmp_path):
    """roles read the snapshot keys from files, never their environment: the run directory's by default (what
    `tidal run` writes), or the files weights.public_key_file / weights.signing_key_file name (a cluster's mounts),
    which must exist; a run directory without key files (a pipeline on kfp.local) is checked by sha256 alone."""
    from tidal.config import config_from_dict
    from tidal.run_keys import load_public_key, load_signing_key, run_key_pair
    from tidal.rundir import RunDir
    from tidal.weights import verify_snapshot
    from tidal.weights.signing import new_key_pair, trusted_public_key

    run, cfg = RunDir(tmp_path / "run"), config_from_dict({})
    run.root.mkdir()
    assert (
        load_public_key(cfg.weights.public_key_file, run) is None
        and load_signing_key(cfg.weights.signing_key_file, run) is None
        and trusted_public_key() is None
    )
    private, public = run_key_pair(run.root)
    assert (load_public_key(cfg.weights.public_key_file, run), load_signing_key(cfg.weights.signing_key_file, run), trusted_public_key()) == (
        public,
        private,
        public,
    )
    unsigned = WeightStore(tmp_path / "weights").publish(1, {"a": torch.zeros(2)})
    with pytest.raises(CorruptSnapshotError, match="its manifest is not signed"):
        verify_snapshot(unsigned)  # the trusted key is every check's default

    mounted_private, mounted_public = new_key_pair()
    (tmp_path / "public-key").write_text(mounted_public + "\n")
    (tmp_path / "private-key").write_text(mounted_private)
    named = config_from_dict({"weights": {"public_key_file": str(tmp_path / "public-key"), "signing_key_file": str(tmp_path / "private-key")}})
    assert (load_public_key(named.weights.public_key_file, run), load_signing_key(named.weights.signing_key_file, run)) == (
        mounted_public,
        mounted_private,
    )
    missing = config_from_dict({"weights": {"public_key_file": str(tmp_path / "absent")}})
    with pytest.raises(FileNotFoundError, match=r"/absent: no such key file \(weights.public_key_file"):
        load_public_key(missing.weights.public_key_file, run)
