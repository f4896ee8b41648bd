"""`tidal bench`: the benchmarks run from the installed package and write their figures."""

import json
from pathlib import Path

import pytest

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


def test_tidal_bench_vision_counts_the_images_each_layout_encodes(tmp_path):
    out = tmp_path / "bench.json"
    args = ["--group-sizes", "3", "--image-side", "56", "--response-len", "4", "--vision-depth", "1", "--vision-embed", "32"]
    proc = run_cli("bench", "vision", *args, "--hidden", "32", "--layers", "1", "--repeats", "1", "--threads", "1", "--json", str(out))
    assert proc.returncode == 0, proc.stderr[-2000:]
    (row,) = json.loads(out.read_text())["results"]
    assert (row["group_size"], row["image_patches"]) == (3, 16)
    assert (row["per_sample_encoder_calls"], row["per_sample_images_encoded"]) == (1, 3)  # G rows, G copies, one call
    assert (row["shared_encoder_calls"], row["shared_images_encoded"]) == (1, 1)
    assert row["per_sample_seconds"] > 0 and row["shared_seconds"] > 0
    assert row["speedup"] == row["per_sample_seconds"] / row["shared_seconds"]
    assert "images encoded per sample 3 vs shared 1" in proc.stdout


def test_an_unknown_benchmark_is_named():
    proc = run_cli("bench", "fastest")
    assert proc.returncode == 2 and "invalid choice: 'fastest'" in proc.stderr


def test_modes_benchmark_times_the_loop_end_to_end_and_leaves_the_warmup_iterations_out():
    from tidal.bench.modes import steady_state

    def it(seconds, end, tokens):
        return {
            "iteration_seconds": seconds,  # the trainer's own timer: only the first iteration's counts
            "wall_time": end,
            "samples": 8.0,
            "generate_seconds": 1.0,
            "train_seconds": 1.0,
            "sync_seconds": 0.1,
            "trainer_idle_seconds": seconds - 2,
            "generated_tokens": tokens,
        }

    metrics = [it(30.0, 1030.0, 100), it(2.5, 1032.0, 100), it(4.5, 1036.0, 300)]  # iteration 0 waited for an engine to start
    figures = steady_state(metrics, warmup=1)
    assert figures["step_seconds"] == [30.0, 2.0, 4.0] and figures["seconds_per_iteration"] == 3.0 and figures["idle_seconds_mean"] == 1.5
    assert figures["generated_tokens_per_s"] == 400 / 6.0 and figures["samples_per_s"] == 16 / 6.0 and figures["iterations_measured"] == 2
    assert steady_state(metrics, warmup=0)["seconds_per_iteration"] == 12.0
    with pytest.raises(SystemExit, match="no iteration left to measure"):
        steady_state(metrics, warmup=3)


def test_modes_benchmark_reports_pipeline_efficiency_and_the_agent_figures_where_recorded():
    from tidal.bench.modes import pipeline, steady_state

    base = {"iteration_seconds": 2.0, "samples": 8.0, "generate_seconds": 1.0, "train_seconds": 1.0, "sync_seconds": 0.1}
    base.update(trainer_idle_seconds=0.0, generated_tokens=10)
    metrics = [
        {**base, "wall_time": 10.0 + 2 * i, "pipeline_efficiency": e, "agent_tool_calls_mean": c, "agent_env_seconds": 0.5}
        | {"generation_tail_seconds": tail, "response_length_p50": 10.0 + i, "response_length_p99": 100.0 * (i + 1)}
        for i, (e, c, tail) in enumerate([(0.1, 0.0, 9.0), (0.5, 0.4, 0.25), (0.7, 0.6, 0.75)])
    ]
    figures = steady_state(metrics, warmup=1)
    assert figures["pipeline_efficiency_mean"] == pytest.approx(0.6) and figures["tool_calls_per_trajectory"] == pytest.approx(0.5)
    assert figures["generation_tail_seconds_mean"] == pytest.approx(0.5) and figures["response_length_p99_mean"] == pytest.approx(250.0)
    shown = pipeline(figures)
    assert "pipeline efficiency 0.60" in shown and "tool calls/trajectory 0.50" in shown
    assert "generation tail 0.50 s" in shown and "response length p50 12 / p99 250 tokens" in shown
    left_out = ("agent_", "pipeline", "generation_tail", "response_length")
    plain = steady_state([{k: v for k, v in m.items() if not k.startswith(left_out)} for m in metrics], warmup=1)
    assert plain["pipeline_efficiency_mean"] is None and plain["tool_calls_per_trajectory"] is None and pipeline(plain) == ""


def test_the_modes_and_trl_benchmarks_time_a_run_and_compare_modes_by_one_function(tmp_path):
    """The same recorded sync and periodic runs (metrics.jsonl of two 12-iteration runs of the example)
    read by `tidal bench modes` and by `tidal bench trl` give the same seconds per iteration, samples/s
    and periodic/sync ratio, all from tidal.bench.timing: the wall time between iteration ends, not the
    trainer's overlapping per-iteration timers."""
    from tidal.bench import modes, timing, versus_trl
    from tidal.rundir import RunDir

    recorded = json.loads((Path(__file__).parent / "data" / "bench_runs.json").read_text())
    assert modes.speedup is versus_trl.speedup is timing.speedup
    assert modes.run_timing is timing.run_timing and versus_trl.iteration_wall_seconds is timing.iteration_wall_seconds
    warmup, by_modes, by_trl = 2, {}, {}
    for name, metrics in recorded.items():
        run = RunDir(tmp_path / name)
        run.root.mkdir()
        for m in metrics:
            run.metrics.append(m)
        run.summary.write_text(json.dumps({"accuracy_before": None}))
        by_modes[name] = modes.run_figures(run, warmup)
        samples = int(metrics[0]["samples"])
        by_trl[name] = versus_trl.summarize_run(versus_trl.tidal_raw(run.metrics.read()), warmup, samples)
        for key in ("seconds_per_iteration", "samples_per_s", "step_seconds"):
            assert by_modes[name][key] == by_trl[name][key], (name, key)
        ends = [m["wall_time"] for m in metrics]
        assert by_modes[name]["seconds_per_iteration"] == pytest.approx((ends[-1] - ends[warmup - 1]) / (len(ends) - warmup))
    rep = {"samples_per_step": samples, "results": by_trl}
    ratio = versus_trl.ratio_table([rep], ["sync", "periodic"])["periodic"]["vs_sync"]
    assert (
        ratio
        == timing.speedup(by_modes["sync"], by_modes["periodic"])
        == pytest.approx(by_modes["sync"]["seconds_per_iteration"] / by_modes["periodic"]["seconds_per_iteration"])
    )
    # the trainer's timers overlap (iteration v+1's starts inside v's boundary): their mean is not the wall time
    for name, metrics in recorded.items():
        timers = sum(m["iteration_seconds"] for m in metrics[warmup:]) / (len(metrics) - warmup)
        assert timers > by_modes[name]["seconds_per_iteration"], name


def test_tidal_bench_trainer_shows_fsdp2_halving_memory_per_rank(tmp_path):
    out = tmp_path / "trainer.json"
    args = [
        "--strategies",
        "single,fsdp2",
        "--hidden",
        "64",
        "--layers",
        "2",
        "--groups",
        "4",
        "--iterations",
        "1",
        "--sync-reps",
        "2",
        "--json",
        str(out),
    ]
    proc = run_cli("bench", "trainer", *args)
    assert proc.returncode == 0, proc.stderr[-2000:]
    report = json.loads(out.read_text())
    results = report["results"]
    assert sorted(results) == ["fsdp2@1", "fsdp2@1+lora", "fsdp2@2", "fsdp2@2+lora", "single@1", "single@1+lora"]
    single, sharded = results["single@1"], results["fsdp2@2"]
    assert all(r["tokens_per_s"] > 0 and r["trained_tokens"] > 0 for r in results.values())
    assert results["fsdp2@1"]["resident_bytes_per_rank"] == single["resident_bytes_per_rank"]  # one rank holds everything
    assert 0.45 < sharded["resident_bytes_per_rank"] / single["resident_bytes_per_rank"] < 0.6  # about half per rank at 2
    assert "share them" in proc.stdout and "fsdp2@2" in proc.stdout
    # LoRA: the frozen base stays resident, only the adapter has gradients and optimizer moments
    (full,), (lora,) = single["ranks"], results["single@1+lora"]["ranks"]
    assert lora["param_bytes"] > full["param_bytes"]  # the base plus the adapter
    assert lora["grad_bytes"] + lora["optimizer_bytes"] < 0.5 * (full["grad_bytes"] + full["optimizer_bytes"])
    assert report["skipped"] == {}
    # fsdp2 shards the frozen base and the adapter: less per rank than LoRA on one process
    assert results["fsdp2@2+lora"]["resident_bytes_per_rank"] < 0.6 * results["single@1+lora"]["resident_bytes_per_rank"]
    # weight sync: every row wrote and loaded versions; a LoRA version is the adapter alone, of any layout
    assert all(r["snapshot_seconds"] > 0 and r["load_seconds"] > 0 for r in results.values())
    assert {r["version_bytes"] for n, r in results.items() if "+lora" in n} == {results["single@1+lora"]["version_bytes"]}
    assert results["single@1+lora"]["version_bytes"] < 0.5 * single["version_bytes"]
    assert single["version_bytes"] == results["fsdp2@2"]["version_bytes"]  # rank 0 gathered the whole model
    assert "snapshot" in proc.stdout and "load" in proc.stdout


def test_tidal_bench_served_reward_writes_both_ways_figures(tmp_path):
    out = tmp_path / "bench.json"
    args = ["--latency", "0.2", "--calls", "2", "--groups-per-call", "2", "--group-size", "2", "--max-new-tokens", "4", "--reps", "1"]
    proc = run_cli("bench", "served-reward", *args, "--json", str(out))
    assert proc.returncode == 0, proc.stderr[-2000:]
    figures = json.loads(out.read_text())
    assert figures["best"]["no_overlap"] > 0 and figures["best"]["overlap"] > 0 and figures["latency"] == 0.2
    assert figures["ratio"] == figures["best"]["no_overlap"] / figures["best"]["overlap"]
    # the pass against the server that answers at once: the generation alone. (Which pass is faster is the
    # benchmark's finding, not a test's: under load the order can flip.) Without overlap each of the 2 calls
    # waits for its scores, which the server holds 0.2 s.
    assert figures["best"]["generation"] > 0 and figures["best"]["no_overlap"] >= 2 * 0.2
    assert "no overlap" in proc.stdout and "generation alone" in proc.stdout


@pytest.mark.parametrize("name", ["modes", "trl"])
def test_modes_and_trl_take_the_config_as_the_docs_write_it_positional_or_option(name):
    """`tidal bench trl examples/arithmetic.yaml` and `tidal bench modes --config ...` (docs/benchmarks.md): both forms, both benchmarks."""
    from tidal.bench import modes, versus_trl

    main = {"modes": modes.main, "trl": versus_trl.main}[name]
    with pytest.raises(SystemExit, match=f"tidal bench {name}: give the config once"):
        main(["a.yaml", "--config", "b.yaml"])
    with pytest.raises(SystemExit, match="--systems"):  # both forms parse; the next check refuses
        main(["a.yaml", "--systems", "nope"])
    with pytest.raises(SystemExit, match="--systems"):
        main(["--config", "a.yaml", "--systems", "nope"])


@pytest.mark.parametrize("name", ["modes", "rollout", "served-reward", "shared-prompt", "trainer", "trainer-step", "trl", "vision"])
def test_each_benchmarks_help_says_what_it_measures_in_whole_sentences(name, capsys):
    import importlib

    from tidal.bench import BENCHMARKS, run_benchmark

    with pytest.raises(SystemExit) as exited:
        run_benchmark(name, ["--help"])
    assert exited.value.code == 0
    words = " ".join(capsys.readouterr().out.split())
    first_paragraph = " ".join(importlib.import_module(BENCHMARKS[name]).__doc__.split("\n\n")[0].split())
    assert first_paragraph.endswith(".") and first_paragraph in words, words[:600]
