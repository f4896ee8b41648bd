"""An environment module that notes every process importing it (a file `imported-PID` in
$TIDAL_TEST_MARKERS): a test tells whether the launcher itself imported it. Only that test uses it."""

import os
from pathlib import Path

from tidal.envs import Environment

if os.environ.get("TIDAL_TEST_MARKERS"):
    Path(os.environ["TIDAL_TEST_MARKERS"], f"imported-{os.getpid()}").write_text("")


class Noted(Environment):
    pass


def noted_parser(text: str, tokenizer=None, tools=None):
    """A user's tool-call parser in this noted module: what it sees goes back in the turn's content."""
    from tidal.envs import ParsedTurn

    seen = {
        "pid": os.getpid(),
        "secrets": sorted(k for k in ("TIDAL_WEIGHTS_SIGNING_KEY", "TIDAL_NATS_TOKEN", "MLFLOW_TRACKING_PASSWORD") if k in os.environ),
        "tokenizer": type(tokenizer).__name__ if tokenizer is not None else None,
        "encoded": tokenizer.encode(text) if tokenizer is not None else None,
    }
    import json

    return ParsedTurn(json.dumps(seen))


def returns_a_string(text: str, tokenizer=None, tools=None):
    return "not a parsed turn"


def raises(text: str, tokenizer=None, tools=None):
    raise RuntimeError("cannot read " + text)
