"""The run's secrets in its directory (RunDir names the files): the weight-signing key pair (the private key 0600,
read by trainer processes alone), a pre-Ed25519 run's HMAC key and its upgrade, and the embedded NATS server's
per-launch token. Each role reads what it needs from the files, never from its environment: the trainer the
private key, every role that loads or checks a snapshot the public key (`weights.signing_key_file` and
`weights.public_key_file` name other files, e.g. a cluster's Secret and ConfigMap mounted into its pods). User
code never reads them: the sandbox hides the run directory."""

from __future__ import annotations

import json
import os
import secrets
from pathlib import Path

from tidal.rundir import RunDir


def nats_token() -> str:
    """A random token nats-server's config parser reads as a string: its `$VAR` reference parses the
    value, so one that starts with a digit or '-' (as token_urlsafe's may) is a number followed by
    junk, and the server refuses to start."""
    return "t" + secrets.token_hex(32)


def write_private(path: Path, text: str) -> None:
    """`text` in a file of mode 0600, replaced atomically (never readable by others, never half written)."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        os.fchmod(fd, 0o600)
        os.write(fd, text.encode())
    finally:
        os.close(fd)
    os.replace(tmp, path)


def run_key_pair(run_dir: Path) -> tuple[str, str]:
    """(private, public) keys of the run's snapshot signatures (tidal.weights.signing), made on the run's first
    launch and kept in RUN_DIR/weights-signing-key (0600) and RUN_DIR/weights-public-key: a resume signs with
    the same key, so the versions written before still verify."""
    from tidal.weights.signing import new_key_pair, public_key_of

    private_path, public_path = RunDir(run_dir).signing_key_file, RunDir(run_dir).public_key_file
    if private_path.is_file():
        private = private_path.read_text().strip()
        public = public_key_of(private)  # the public file is derived: rewritten if it went missing or was changed
    else:
        private, public = new_key_pair()
        write_private(private_path, private)
    if not public_path.is_file() or public_path.read_text().strip() != public:
        public_path.write_text(public)
    return private, public


def key_file(configured: str | None, default: Path) -> Path | None:
    """The key file a role reads: the configured one (it must exist: a cluster's mount that is missing is an
    error), else the run directory's, None when the run directory has none (a pipeline run on kfp.local, a run
    directory from before Ed25519 signing that no launch has upgraded: its snapshots are checked by sha256)."""
    if configured:
        if not Path(configured).is_file():
            raise FileNotFoundError(f"{configured}: no such key file (weights.public_key_file / weights.signing_key_file)")
        return Path(configured)
    return default if default.is_file() else None


def load_public_key(configured: str | None, run: RunDir) -> str | None:
    """The run's public key, read from its file (`configured`: weights.public_key_file, else
    RUN_DIR/weights-public-key) and trusted by every snapshot check of this process from now on; None when there
    is no key file."""
    from tidal.weights.signing import read_key_file, trust_public_key

    path = key_file(configured, run.public_key_file)
    public = read_key_file(path, private=False) if path else None
    trust_public_key(public)
    return public


def load_signing_key(configured: str | None, run: RunDir) -> str | None:
    """The trainer's private key (`configured`: weights.signing_key_file, else RUN_DIR/weights-signing-key):
    trainer processes alone call this."""
    from tidal.weights.signing import read_key_file

    path = key_file(configured, run.signing_key_file)
    return read_key_file(path, private=True) if path else None


def run_public_key(run_dir: Path) -> str | None:
    """The run's public key as its trainer's processes saw it: the one this process trusts (a role of the run, a
    cluster's pod, which read it from its key file) first, else RUN_DIR/weights-public-key (a user's `tidal eval`
    or `tidal export`); None: a run directory from before Ed25519 signing that no launch has upgraded."""
    from tidal.weights.signing import trusted_public_key

    path = RunDir(run_dir).public_key_file
    return trusted_public_key() or (path.read_text().strip() if path.is_file() else None)


def snapshot_keys(run_dir: Path) -> dict:
    """verify_snapshot's keys for a user's command on a run directory (`tidal eval`, `tidal export`): its public key,
    else, for a run directory from before Ed25519 signing that no launch has upgraded, its HMAC key."""
    public = run_public_key(run_dir)
    hmac_path = RunDir(run_dir).hmac_key_file
    if public or not hmac_path.is_file():
        return {"public_key": public}
    return {"hmac_key": hmac_path.read_text().strip().encode()}


def upgrade_hmac_run(run_dir: Path, weights_root: Path, private: str) -> list[str]:
    """A run directory from before Ed25519 signing (it has RUN_DIR/weights-key): every snapshot whose HMAC
    verifies with that key is re-signed with `private` (its manifest replaced atomically; the sha256s stay),
    then the symmetric key is deleted, so no process of the run holds a key that could sign. A snapshot
    whose HMAC does not verify keeps it, and every loader refuses it. Returns what it refused to re-sign.
    Call it with the run directory locked and no role running."""
    from tidal.weights.signing import resign_hmac_manifest

    key_path = RunDir(run_dir).hmac_key_file
    if not key_path.is_file():
        return []
    hmac_key = key_path.read_text().strip().encode()
    refused = []
    for manifest_path in sorted(Path(weights_root).glob("v*/manifest.json")):
        try:
            manifest = json.loads(manifest_path.read_text())
        except (OSError, json.JSONDecodeError):
            refused.append(str(manifest_path.parent))
            continue
        if not isinstance(manifest, dict) or "hmac" not in manifest:
            continue  # already re-signed (an upgrade cut short), or never signed
        resigned = resign_hmac_manifest(manifest, hmac_key, private)
        if resigned is None:
            refused.append(str(manifest_path.parent))
            continue
        tmp = manifest_path.with_name(f".{manifest_path.name}.{os.getpid()}")
        tmp.write_text(json.dumps(resigned, indent=1))
        os.replace(tmp, manifest_path)
    key_path.unlink()
    return refused


def new_nats_token(run_dir: Path) -> str:
    """A fresh random token for this launch's embedded nats-server, in RUN_DIR/nats-token (mode 0600,
    replaced atomically): the server gets it through its environment, roles read the file (--nats-token-file);
    user code never sees the run directory."""
    token = nats_token()
    write_private(RunDir(run_dir).nats_token_file, token)
    return token
