"""`python -m tidal.weights.keygen DIR`: a cluster's snapshot keys (tidal.weights.signing), as files for the
trainer's Secret and everyone's ConfigMap (docs/kubernetes.md)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

from tidal.weights.signing import new_key_pair


def write_key_pair(directory: Path) -> tuple[Path, Path]:
    """A new key pair as files for a cluster's Secret and ConfigMap: DIR/private-key (mode 0600), DIR/public-key.
    Refuses to replace a private key: the snapshots it signed would no longer verify."""
    directory.mkdir(parents=True, exist_ok=True)
    private_path, public_path = directory / "private-key", directory / "public-key"
    private, public = new_key_pair()
    try:
        fd = os.open(private_path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        raise FileExistsError(
            f"{private_path} already exists: a new key would not verify what the old one signed; choose another directory"
        ) from None
    with os.fdopen(fd, "w") as fh:
        fh.write(private)
    public_path.write_text(public)
    return private_path, public_path


def main(argv: list[str] | None = None) -> int:
    """`python -m tidal.weights.keygen DIR`: a cluster's snapshot keys (docs/kubernetes.md)."""
    import argparse

    parser = argparse.ArgumentParser(prog="python -m tidal.weights.keygen", description=main.__doc__)
    parser.add_argument("directory", type=Path, help="where to write private-key (0600) and public-key")
    args = parser.parse_args(argv)
    try:
        private_path, public_path = write_key_pair(args.directory)
    except FileExistsError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(f"wrote {private_path} (the trainer's, mode 0600) and {public_path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
