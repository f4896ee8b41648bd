"""A latency for the run's tools (rollout.agent.tool_latency): how long each call of a tool takes on top of its
own running time, drawn from a heavy-tailed distribution, to measure how the modes cope with slow
tools (`tidal bench modes --set rollout.agent.tool_latency=...`).

The distribution is log-normal, given by its median and the ratio of its 99th percentile to its
median: latency = p50 * exp(sigma * z), z standard normal, sigma = ln(p99/p50) / z_0.99
(z_0.99 = 2.3263...). A ratio of 10 gives sigma 0.99: the mean is 1.63 x p50 and one call in a
hundred takes over 10 x p50. Call n of a tool process's parent draws its z from a generator seeded
with (seed, n), so a run's latencies repeat from run to run (the HF engine makes its calls in row
order); the latency never changes what a tool returns, only when.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

Z99 = 2.3263478740408408  # the standard normal distribution's 99th percentile


def lognormal_sigma(p99_over_p50: float) -> float:
    """The log-normal sigma whose 99th percentile is `p99_over_p50` times its median."""
    if p99_over_p50 < 1:
        raise ValueError(f"p99_over_p50 must be at least 1, got {p99_over_p50}")
    return math.log(p99_over_p50) / Z99


def lognormal_mean_over_p50(p99_over_p50: float) -> float:
    """The mean over the median of that log-normal: exp(sigma^2 / 2)."""
    return math.exp(lognormal_sigma(p99_over_p50) ** 2 / 2)


def lognormal_draw(p50: float, p99_over_p50: float, key: str) -> float:
    """One draw of that log-normal with median `p50`, from a generator seeded with `key` (the same key, the same draw)."""
    return p50 * math.exp(lognormal_sigma(p99_over_p50) * random.Random(key).gauss(0.0, 1.0))


@dataclass(frozen=True)
class ToolLatency:
    """rollout.agent.tool_latency, with the run's seed: `seconds(n)` is call n's latency."""

    p50_seconds: float
    p99_over_p50: float = 10.0
    seed: int = 0

    @classmethod
    def from_config(cls, latency, seed: int) -> ToolLatency | None:
        return None if latency is None else cls(latency.p50_seconds, latency.p99_over_p50, seed)

    def seconds(self, call: int) -> float:
        return lognormal_draw(self.p50_seconds, self.p99_over_p50, f"tidal-tool-latency:{self.seed}:{call}")
