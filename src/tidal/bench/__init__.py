"""Benchmarks (`tidal bench NAME`): each measures Tidal against a baseline in the same run and
prints the ratio; `--json PATH` writes the figures."""

BENCHMARKS = {
    "modes": "tidal.bench.modes",  # sync vs periodic vs bounded: seconds per iteration, held-out accuracy
    "rollout": "tidal.bench.rollout",  # HF engine vs vLLM: tokens/s, time to first group
    "served-reward": "tidal.bench.served_reward",  # scoring after each engine call vs beside the next: seconds, ratio
    "shared-prompt": "tidal.bench.shared_prompt",  # naive vs shared-prompt packing: step time, peak memory
    "trainer": "tidal.bench.trainer",  # single vs fsdp2 vs deepspeed at 1 and 2 ranks: tokens/s, memory per rank
    "trainer-step": "tidal.bench.trainer_step",  # one trainer step on a model built from a config: tokens/s, MFU
    "trl": "tidal.bench.versus_trl",
    "vision": "tidal.bench.vision",  # one image per group: encoded per sample vs once per group (calls, seconds, memory)  # TRL's GRPOTrainer vs Tidal sync and periodic: s/step, samples/s, a gradient check
}


def run_benchmark(name: str, argv: list[str]) -> None:
    import importlib

    importlib.import_module(BENCHMARKS[name]).main(argv)
