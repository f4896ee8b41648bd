"""rollout.agent.tool_latency: a heavy-tailed latency on every call of the run's tools (benchmarks of slow
tools). The distribution's maths is a pure function; the latency is slept in the tools' process,
drawn per call from the run's seed."""

from __future__ import annotations

import math
import statistics
import time

import pytest

from tidal.config import ConfigError, load_config
from tidal.envs import ToolHost, ToolLimits, resolve_tool
from tidal.envs.latency import ToolLatency, lognormal_mean_over_p50, lognormal_sigma


def test_lognormal_sigma_puts_the_99th_percentile_at_the_ratio():
    """A log-normal with median m and this sigma has its 99th percentile at ratio x m: checked against the
    normal distribution's own quantile (statistics.NormalDist), and its mean against a numerical integral."""
    z99 = statistics.NormalDist().inv_cdf(0.99)
    for ratio in (1.0, 2.0, 10.0, 37.0):
        assert math.exp(z99 * lognormal_sigma(ratio)) == pytest.approx(ratio, rel=1e-3)
        sigma, steps = lognormal_sigma(ratio), 20000
        # E[exp(sigma Z)] by the midpoint rule over z in [-10, 10]
        mean = sum(math.exp(sigma * z) * statistics.NormalDist().pdf(z) for z in (-10 + (i + 0.5) * 20 / steps for i in range(steps))) * 20 / steps
        assert lognormal_mean_over_p50(ratio) == pytest.approx(mean, rel=1e-4)
    with pytest.raises(ValueError, match="at least 1"):
        lognormal_sigma(0.5)


def test_draws_have_the_median_and_tail_asked_for_and_repeat_per_call():
    latency = ToolLatency(0.05, 10.0, seed=3)
    draws = sorted(latency.seconds(n) for n in range(20000))
    p50, p99 = draws[10000], draws[19800]
    assert p50 == pytest.approx(0.05, rel=0.05) and p99 / p50 == pytest.approx(10.0, rel=0.15)
    assert statistics.fmean(draws) / 0.05 == pytest.approx(lognormal_mean_over_p50(10.0), rel=0.05)
    assert [latency.seconds(n) for n in range(5)] == [ToolLatency(0.05, 10.0, seed=3).seconds(n) for n in range(5)]
    assert latency.seconds(0) != ToolLatency(0.05, 10.0, seed=4).seconds(0)


def test_the_config_key_and_its_bounds(tmp_path):
    cfg = load_config("examples/calculator.yaml", ["rollout.agent.tool_latency.p50_seconds=0.05", "rollout.agent.tool_latency.p99_over_p50=10"])
    latency = cfg.rollout.agent.tool_latency
    assert (latency.distribution, latency.p50_seconds, latency.p99_over_p50) == (
        "lognormal",
        0.05,
        10.0,
    )
    assert ToolLimits.from_config(cfg.rollout.agent, cfg.seed).latency == ToolLatency(0.05, 10.0, 0)
    assert load_config("examples/calculator.yaml").rollout.agent.tool_latency is None
    with pytest.raises(ConfigError, match="p99_over_p50"):
        load_config("examples/calculator.yaml", ["rollout.agent.tool_latency.p50_seconds=0.05", "rollout.agent.tool_latency.p99_over_p50=0.5"])
    with pytest.raises(ConfigError, match=r"rollout\.agent\.env: Field required"):
        load_config("examples/arithmetic.yaml", ["rollout.agent.tool_latency.p50_seconds=0.05"])  # only with an environment


def test_the_tool_process_waits_the_drawn_latency_before_answering():
    host = ToolHost(["calc"], ToolLimits(latency=ToolLatency(0.3, 1.0)))  # ratio 1: every call takes the median
    calc = host.isolate(resolve_tool("calc"))
    try:
        calc({"expression": "1+1"})  # the process starts
        started = time.monotonic()
        result = calc({"expression": "6*7"})
        waited = time.monotonic() - started
    finally:
        host.close()
    assert result.text == "42" and not result.error
    assert 0.3 <= waited < 5
