"""`tidal bench`: the benchmarks run from the installed package and write their figures."""

import json

from tests.conftest import run_cli


def test_tidal_bench_shared_prompt_writes_both_layouts_figures(tmp_path):
    out = tmp_path / "bench.json"
    proc = run_cli(
        "bench", "shared-prompt", "--prompt-len", "24", "--response-len", "8", "--group-size", "3",
        "--repeats", "1", "--layers", "1", "--hidden", "32", "--heads", "2", "--threads", "1", "--json", str(out),
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
