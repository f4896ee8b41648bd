"""The run's tools (rollout.agent.tools) in a process of the worker's own (`python -m tidal.envs.host`,
tidal.hosted): a tool that hangs past rollout.agent.tool_timeout_seconds, crashes, exits, or goes over its
CPU-time or memory limit fails that one call, with an error text the model reads; the process is
replaced and the worker, its other trajectories and the run go on. Arguments cross as JSON, results
as text; nothing is pickled. An environment's own tools (`@tool` methods, its `tools` attribute)
hold the trajectory's state and run in the worker."""

from __future__ import annotations

import itertools
import queue
import threading
from dataclasses import dataclass, replace

from tidal.envs.latency import ToolLatency
from tidal.envs.tools import EnvError, Tool, ToolResult, without_parameters
from tidal.hosted import STARTUP_SECONDS, HostCallError, HostProcess, HostStartError


def _runs_in_its_host(**arguments):
    raise RuntimeError("an isolated tool runs in its tool process")  # Tool.__call__ sends it to its host


@dataclass(frozen=True)
class ToolLimits:
    """rollout.agent.tool_timeout_seconds, tool_cpu_seconds, tool_memory_mb and tool_output_bytes."""

    timeout_seconds: float = 30.0
    cpu_seconds: int | None = 60
    memory_mb: int | None = 4096
    output_bytes: int = 65536
    processes: int = 4  # at most this many calls at once (the vLLM engine steps trajectories concurrently)
    latency: ToolLatency | None = None  # rollout.agent.tool_latency: each call waits this long in the tool's process first

    @classmethod
    def from_config(cls, agent, seed: int = 0) -> ToolLimits:
        return cls(
            agent.tool_timeout_seconds,
            agent.tool_cpu_seconds,
            agent.tool_memory_mb,
            agent.tool_output_bytes,
            agent.tool_processes,
            ToolLatency.from_config(agent.tool_latency, seed),
        )

    def rlimit_args(self) -> list[str]:
        """A host's memory and per-call CPU-time limits, as tidal.hosted.serve's hosts take them."""
        args = [f"--memory-mb={self.memory_mb}"] if self.memory_mb else []
        return [*args, f"--cpu-seconds={self.cpu_seconds}"] if self.cpu_seconds else args

    def host_args(self) -> list[str]:
        return [f"--output-bytes={self.output_bytes}", *self.rlimit_args()]


class ToolHost:
    """Up to `limits.processes` processes for the named tools, each started when calls first overlap
    that much, and replaced after a failure; a call takes an idle one (one call per process at a time)."""

    def __init__(self, names: list[str], limits: ToolLimits):
        self.names, self.limits = names, limits
        self.processes: list[HostProcess] = []
        self.idle: queue.LifoQueue[HostProcess] = queue.LifoQueue()
        self.lock = threading.Lock()
        self.calls = itertools.count()  # call n's latency is rollout.agent.tool_latency's draw n

    def _new_process(self) -> HostProcess:
        limits = self.limits
        return HostProcess(
            "tidal.envs.host",
            [*limits.host_args(), *self.names],
            limits.timeout_seconds,
            "rollout.agent.tool_timeout_seconds",
            memory_mb=limits.memory_mb,
        )

    def _acquire(self) -> HostProcess:
        try:
            return self.idle.get_nowait()
        except queue.Empty:
            pass
        with self.lock:
            if len(self.processes) < self.limits.processes:
                self.processes.append(self._new_process())
                return self.processes[-1]
        return self.idle.get()

    def run(self, tool: Tool, arguments: dict) -> ToolResult:
        """`tool` (arguments checked) in a process; every failure is an error text."""
        process = self._acquire()
        try:
            return self._run(process, tool, arguments)
        finally:
            self.idle.put(process)

    def _run(self, process: HostProcess, tool: Tool, arguments: dict) -> ToolResult:
        try:
            call = {"fn": tool.reference, "arguments": arguments}
            if self.limits.latency is not None:
                call["delay"] = self.limits.latency.seconds(next(self.calls))
            reply = process.request(call)
        except HostCallError as err:
            failure = "timeout" if err.kind == "Timeout" else "crash"
            return ToolResult(f"error: {tool.name} failed: {err}", True, failure)
        except HostStartError as err:
            return ToolResult(f"error: {tool.name} failed: its process did not start: {err}", True, "crash")
        if "error" in reply:
            if reply["error"].startswith("MemoryError"):
                process.stop()  # what the tool left allocated would fail the next call too
            return ToolResult(f"error: {tool.name} raised {reply['error']}", True)
        if "cut" in reply:
            return ToolResult(f"{reply['text']}… [cut: {reply['cut']} bytes, over rollout.agent.tool_output_bytes]", False, cut=True)
        return ToolResult(reply["text"], False)

    def isolate(self, tool: Tool) -> Tool:
        return replace(tool, host=self)

    def tools(self, fixed: dict[str, dict] | None = None) -> list[Tool]:
        """The named tools, their schemas from a tool process (which imports the user's modules, so
        the worker never does), each run in this host; `fixed`: per name, arguments the run sets
        (hidden from the schema the model sees)."""
        fixed = fixed or {}
        process = self._acquire()
        try:
            reply = process.request({"describe": True}, timeout=max(STARTUP_SECONDS, self.limits.timeout_seconds))  # an import, like a start
        except (HostStartError, HostCallError) as err:
            raise EnvError(f"rollout.agent.tools: {err}") from None
        finally:
            self.idle.put(process)
        if "error" in reply:
            raise EnvError(reply["error"].removeprefix("EnvError: "))
        schemas = reply["schemas"]
        return [
            Tool(
                schemas[n]["function"]["name"],
                _runs_in_its_host,
                without_parameters(schemas[n], set(fixed.get(n, {}))),
                n,
                self,
                dict(fixed.get(n, {})),
            )
            for n in self.names
        ]

    def close(self) -> None:
        with self.lock:
            for process in self.processes:
                process.close()
