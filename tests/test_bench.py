"""`tidal bench`: the benchmarks run from the installed package and write their figures."""

import json

from tests.conftest import run_cli


def test_tidal_bench_shared_prompt_writes_both_layouts_figures(tmp_path):
    out = tmp_path / "bench.json"
    proc = run_cli(
        "bench",
        "shared-prompt",
        "--prompt-len",
        "24",
        "--response-len",
        "8",
        "--group-size",
        "3",
        "--repeats",
        "1",
        "--layers",
        "1",
        "--hidden",
        "32",
        "--heads",
        "2",
        "--threads",
        "1",
        "--json",
        str(out),
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    (row,) = json.loads(out.read_text())["results"]
    assert (row["prompt_len"], row["response_len"], row["group_size"]) == (24, 8, 3)
    assert row["naive_seconds"] > 0 and row["shared_seconds"] > 0
    assert row["speedup"] == row["naive_seconds"] / row["shared_seconds"]
    assert "speedup" in proc.stdout


def test_an_unknown_benchmark_is_named():
    proc = run_cli("bench", "fastest")
    assert proc.returncode == 2 and "invalid choice: 'fastest'" in proc.stderr


def test_modes_benchmark_leaves_the_warmup_iterations_out():
    import pytest

    from tidal.bench.modes import steady_state

    def it(seconds, tokens):
        return {
            "iteration_seconds": seconds,
            "generate_seconds": 1.0,
            "train_seconds": 1.0,
            "sync_seconds": 0.1,
            "trainer_idle_seconds": seconds - 2,
            "generated_tokens": tokens,
        }

    metrics = [it(30.0, 100), it(2.0, 100), it(4.0, 300)]  # iteration 0 waited for an engine to start
    figures = steady_state(metrics, warmup=1)
    assert figures["iteration_seconds_mean"] == 3.0 and figures["idle_seconds_mean"] == 1.0
    assert figures["generated_tokens_per_s"] == 400 / 6.0 and figures["iterations_measured"] == 2
    assert steady_state(metrics, warmup=0)["iteration_seconds_mean"] == 12.0
    with pytest.raises(SystemExit, match="must exceed --warmup"):
        steady_state(metrics, warmup=3)


def test_tidal_bench_trainer_shows_fsdp2_halving_memory_per_rank(tmp_path):
    out = tmp_path / "trainer.json"
    args = ["--strategies", "single,fsdp2", "--hidden", "64", "--layers", "2", "--groups", "4", "--iterations", "1", "--json", str(out)]
    proc = run_cli("bench", "trainer", *args)
    assert proc.returncode == 0, proc.stderr[-2000:]
    results = json.loads(out.read_text())["results"]
    assert sorted(results) == ["fsdp2@1", "fsdp2@2", "single@1"]
    single, sharded = results["single@1"], results["fsdp2@2"]
    assert all(r["tokens_per_s"] > 0 and r["trained_tokens"] > 0 for r in results.values())
    assert results["fsdp2@1"]["resident_bytes_per_rank"] == single["resident_bytes_per_rank"]  # one rank holds everything
    assert 0.45 < sharded["resident_bytes_per_rank"] / single["resident_bytes_per_rank"] < 0.6  # about half per rank at 2
    assert "share them" in proc.stdout and "fsdp2@2" in proc.stdout
