"""A user's tool-call parser (`rollout.agent.tool_parser: module:function`) in a sandboxed process of the
worker's own, like the tools: it reads text the model wrote, and it is user code, so it gets nothing of
the run. The worker never imports its module.

Host side: `python -m tidal.envs.parser_host [--tokenizer DIR] [--memory-mb M] [--cpu-seconds S]
module:function` (tidal.hosted.serve). The parent writes `{"parse": text, "tools": [schema...] | null}`;
the host answers a turn as `turn_as_json` writes it, or `{"error": "Type: message"}`. `--tokenizer`: a
copy of the worker's tokenizer files (a folder the sandbox may read), loaded here for the parser's
`tokenizer=` argument.

The parent's side is tidal.envs.hosted_parser."""

from __future__ import annotations

import argparse
import sys

from tidal.hosted import serve


def answer(call: dict, parser, tokenizer) -> dict:
    from tidal.envs.parsing import ParsedTurn, turn_as_json

    if call.get("check"):
        return {"ok": True}
    try:
        turn = parser(str(call["parse"]), tokenizer=tokenizer, tools=call.get("tools"))
    except Exception as err:  # noqa: BLE001 - user code: the worker names it
        return {"error": f"{type(err).__name__}: {err}"}
    if not isinstance(turn, ParsedTurn):
        return {"error": f"TypeError: returned {type(turn).__name__}, not a tidal.envs.ParsedTurn"}
    try:
        return turn_as_json(turn)
    except (TypeError, ValueError) as err:
        return {"error": f"TypeError: its ParsedTurn does not cross as JSON ({err})"}


def load(reference: str, tokenizer_folder: str | None):
    from tidal.envs.parsing import resolve_tool_call_parser

    parser = resolve_tool_call_parser(reference)
    tokenizer = None
    if tokenizer_folder:
        from tidal.model.loading import load_tokenizer

        tokenizer = load_tokenizer(tokenizer_folder)
    return lambda call: answer(call, parser, tokenizer)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m tidal.envs.parser_host")
    parser.add_argument("--memory-mb", type=int)
    parser.add_argument("--cpu-seconds", type=int)
    parser.add_argument("--tokenizer")
    parser.add_argument("reference")
    args = parser.parse_args(argv)
    return serve(lambda: load(args.reference, args.tokenizer), args.memory_mb, args.cpu_seconds)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
