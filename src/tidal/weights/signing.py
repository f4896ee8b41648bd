"""Who wrote a snapshot: the run's trainer signs each version's manifest with an Ed25519 private key that
only trainer processes hold; every other process (rollout workers, evaluation, export, a cluster's
pipeline steps) holds the public key, which checks a signature but cannot make one.

Keys travel as hex text (raw 32-byte keys) in files: one line fits a run directory's key file and a
Kubernetes Secret or ConfigMap mounted as a file alike (tidal.run_keys says which file a role reads). A process
that checks snapshots says once which public key it trusts (`trust_public_key`); every check without a key of
its own uses that one."""

from __future__ import annotations

import hashlib
import hmac
import json
from pathlib import Path

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

ALG = "ed25519"
SIGNATURE_FIELD = "signature"
HMAC_FIELD = "hmac"  # runs from before Ed25519 signing: HMAC-SHA256 under RUN_DIR/weights-key (see resign_hmac_manifest)


def new_key_pair() -> tuple[str, str]:
    """(private, public), hex."""
    private = Ed25519PrivateKey.generate()
    return private.private_bytes_raw().hex(), private.public_key().public_bytes_raw().hex()


def _raw_key(text: str, what: str) -> bytes:
    try:
        raw = bytes.fromhex(text.strip())
    except ValueError:
        raw = b""
    if len(raw) != 32:
        raise ValueError(f"{what}: not an {ALG} key (64 hex digits expected, got {len(text.strip())} characters)")
    return raw


def private_key(text: str, what: str = "the snapshot-signing key") -> Ed25519PrivateKey:
    return Ed25519PrivateKey.from_private_bytes(_raw_key(text, what))


def public_key(text: str, what: str = "the snapshots' public key") -> Ed25519PublicKey:
    return Ed25519PublicKey.from_public_bytes(_raw_key(text, what))


def public_key_of(private_hex: str) -> str:
    return private_key(private_hex).public_key().public_bytes_raw().hex()


def read_key_file(path: Path, private: bool) -> str:
    """The hex key in `path`, checked now (a malformed key is an error naming the file, not a refusal at the
    first snapshot)."""
    text = Path(path).read_text().strip()
    (private_key if private else public_key)(text, str(path))
    return text


_trusted_public_key: str | None = None


def trust_public_key(public_hex: str | None) -> None:
    """The public key every snapshot check of this process uses unless it is given one (a role sets it once, from
    the key file it reads); None: no signature is checked, only the sha256s (a store outside any run)."""
    global _trusted_public_key
    if public_hex:
        public_key(public_hex)
    _trusted_public_key = public_hex or None


def trusted_public_key() -> str | None:
    return _trusted_public_key


def signed_body(manifest: dict) -> bytes:
    """What a signature covers: the whole manifest but its signatures, in one canonical form."""
    return json.dumps({k: v for k, v in manifest.items() if k not in (SIGNATURE_FIELD, HMAC_FIELD)}, sort_keys=True).encode()


def manifest_signature(manifest: dict, private_hex: str) -> dict:
    """The `signature` field of `manifest` under the trainer's private key. The public key is recorded so that
    a refusal can say which key signed; a check never trusts it (it verifies with the run's public key)."""
    key = private_key(private_hex)
    return {"alg": ALG, "public_key": public_key_of(private_hex), "value": key.sign(signed_body(manifest)).hex()}


def signature_problem(manifest: dict, public_hex: str) -> str | None:
    """Why `manifest` is not signed by the holder of `public_hex`'s private key; None when it is."""
    sig = manifest.get(SIGNATURE_FIELD)
    if sig is None:
        if HMAC_FIELD in manifest:
            return (
                "its manifest has only an HMAC-SHA256 signature from before Ed25519 signing, which the launcher did not "
                "re-sign (it did not verify with the run's weights-key)"
            )
        return "its manifest is not signed"
    if not isinstance(sig, dict) or not all(isinstance(sig.get(k), str) for k in ("alg", "public_key", "value")):
        return f"its manifest's {SIGNATURE_FIELD} field is malformed (expected alg, public_key, value)"
    if sig["alg"] != ALG:
        return f"its manifest is signed with {sig['alg']!r}, not {ALG}"
    if sig["public_key"] != public_hex.strip():
        return f"its manifest is signed with {ALG} key {sig['public_key'][:16]}…, not this run's trainer key {public_hex.strip()[:16]}…"
    try:
        public_key(public_hex).verify(bytes.fromhex(sig["value"]), signed_body(manifest))
    except (InvalidSignature, ValueError):
        return f"its manifest's {ALG} signature does not verify with this run's trainer key (the manifest changed after it was signed)"
    return None


def hmac_signature(manifest: dict, key: bytes) -> str:
    """The HMAC-SHA256 a trainer from before Ed25519 signing put in a manifest's `hmac` field."""
    body = json.dumps({k: v for k, v in manifest.items() if k != HMAC_FIELD}, sort_keys=True).encode()
    return hmac.new(key, body, hashlib.sha256).hexdigest()


def hmac_problem(manifest: dict, hmac_key: bytes) -> str | None:
    """signature_problem for a run directory from before Ed25519 signing that no launch has upgraded yet."""
    if HMAC_FIELD not in manifest:
        return "its manifest is not signed"
    if not hmac.compare_digest(str(manifest[HMAC_FIELD]), hmac_signature(manifest, hmac_key)):
        return "its manifest's HMAC-SHA256 does not match the run's weights-key"
    return None


def resign_hmac_manifest(manifest: dict, hmac_key: bytes, private_hex: str) -> dict | None:
    """An HMAC-era manifest re-signed with the trainer's private key (its HMAC dropped); None when its HMAC
    does not verify with `hmac_key`, so the run's old key never vouches for what it did not sign."""
    if hmac_problem(manifest, hmac_key):
        return None
    body = {k: v for k, v in manifest.items() if k != HMAC_FIELD}
    return {**body, SIGNATURE_FIELD: manifest_signature(body, private_hex)}
