"""The parent's side of a user's tool-call parser in its sandboxed process (the host's side, and why,
is tidal.envs.parser_host): `HostedParser` is a parser (`fn(text, tokenizer=None, tools=None) ->
ParsedTurn`) that asks its process. A call that fails (the parser raised, returned something else,
hung or crashed) is an EnvError naming the parser; a crashed process is replaced at the next call."""

from __future__ import annotations

import dataclasses
import shutil
import tempfile

from tidal import sandbox
from tidal.envs.isolation import ToolLimits
from tidal.envs.parsing import ParsedTurn, turn_from_json
from tidal.envs.tools import EnvError
from tidal.hosted import HostCallError, HostProcess, HostStartError


class HostedParser:
    """`reference`'s parser in a sandboxed process; `tokenizer` (optional) is saved to a folder that
    process may read, and loaded there."""

    def __init__(self, reference: str, limits: ToolLimits, tokenizer=None):
        self.reference = reference
        self.folder = None
        args = limits.rlimit_args()
        policy = sandbox.current()
        if tokenizer is not None:
            self.folder = tempfile.mkdtemp(prefix="tidal-parser-tokenizer-")
            tokenizer.save_pretrained(self.folder)
            args.append(f"--tokenizer={self.folder}")
            policy = dataclasses.replace(policy, read_paths=(*policy.read_paths, self.folder))
        self.process = HostProcess(
            "tidal.envs.parser_host",
            [*args, reference],
            limits.timeout_seconds,
            "rollout.agent.tool_timeout_seconds",
            memory_mb=limits.memory_mb,
            policy=policy,
        )

    def check(self) -> None:
        """Starts the process: a module that cannot be imported, or no parser in it, is an EnvError now."""
        try:
            self.process.request({"check": True})
        except (HostStartError, HostCallError) as err:
            raise EnvError(f"rollout.agent.tool_parser {self.reference!r}: {err}") from None

    def __call__(self, text: str, tokenizer=None, tools: list[dict] | None = None) -> ParsedTurn:
        try:
            reply = self.process.request({"parse": text, "tools": tools})
        except (HostStartError, HostCallError) as err:
            raise EnvError(f"rollout.agent.tool_parser {self.reference!r} failed: {err}") from None
        if "error" in reply:
            raise EnvError(f"rollout.agent.tool_parser {self.reference!r} raised {reply['error']}")
        return turn_from_json(reply, f"rollout.agent.tool_parser {self.reference!r}")

    def close(self) -> None:
        self.process.close()
        if self.folder is not None:
            shutil.rmtree(self.folder, ignore_errors=True)
            self.folder = None
