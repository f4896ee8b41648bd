"""Benchmarks (`tidal bench NAME`): each measures Tidal against a baseline in the same run and
prints the ratio; `--json PATH` writes the figures."""

BENCHMARKS = {
    "modes": "tidal.bench.modes",  # sync vs periodic: seconds per iteration and its split
    "rollout": "tidal.bench.rollout",  # HF engine vs vLLM: tokens/s, time to first group
    "shared-prompt": "tidal.bench.shared_prompt",  # naive vs shared-prompt packing: step time, peak memory
}


def run_benchmark(name: str, argv: list[str]) -> None:
    import importlib

    importlib.import_module(BENCHMARKS[name]).main(argv)
