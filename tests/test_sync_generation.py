"""Sync mode's generation (generate_groups) runs the engine on the thread that asks for the groups: the
learner's compute thread, whose OpenMP team of torch threads also trains. A new thread per call would
bring a second team onto the same cores."""

import asyncio
import threading

import torch

from tidal.config import TinyModelConfig, config_from_dict
from tidal.demo.tiny import build_char_tokenizer, build_tiny_model
from tidal.protocol import WorkItem
from tidal.rewards import RewardScorer
from tidal.rollout.engine import HFEngine
from tidal.rollout.generator import Generator, generate_groups


class ThreadRecordingEngine(HFEngine):
    """The real HF engine, noting the thread each generate call runs on."""

    threads: list[int]

    def generate(self, requests, greedy=False, max_new_tokens=None):
        self.threads.append(threading.get_ident())
        return super().generate(requests, greedy, max_new_tokens)


def setup():
    cfg = config_from_dict({"rollout": {"group_size": 3, "max_new_tokens": 4, "generation_token_budget": 64}})
    tok = build_char_tokenizer()
    torch.manual_seed(0)
    model = build_tiny_model(TinyModelConfig(hidden_size=32, intermediate_size=64, num_layers=2, num_heads=2, num_kv_heads=1), tok).eval()
    engine = ThreadRecordingEngine(model, tok.eos_token_id, tok.pad_token_id, cfg.rollout.max_new_tokens)
    engine.threads = []
    items = [WorkItem(1, i, f"{i}+{i + 3}=", str(2 * i + 3)) for i in range(5)]
    return cfg, tok, engine, items


def samples(groups):
    return [(g.prompt_id, [s.token_ids.tolist() for s in g.samples], [s.reward for s in g.samples]) for g in groups]


def test_sync_generation_runs_every_engine_call_on_the_calling_thread():
    cfg, tok, engine, items = setup()
    groups = generate_groups(engine, tok, RewardScorer.from_config(cfg.reward), items, cfg, version=1, worker_id="sync")
    assert len(engine.threads) > 1, "the budget should split the items over several engine calls"
    assert set(engine.threads) == {threading.get_ident()}

    # the same groups as through the async protocol, whose HF engine runs each call on another thread
    engine.threads = []

    async def through_the_protocol():
        generator = Generator(cfg, engine, tok, RewardScorer.from_config(cfg.reward), "sync")
        return [g async for call in generator.calls(items, 1) for g in call]

    protocol_groups = asyncio.run(through_the_protocol())
    assert threading.get_ident() not in engine.threads
    assert samples(protocol_groups) == samples(groups)


def test_only_a_store_whose_versions_engines_load_carries_the_arrival_probe(tiny_config, tmp_path):
    """Sync mode's HF engine generates with the learner's own weights: no engine loads a version, so the
    trainer runs no probe forward per version and publishes none; every other trainer does."""
    from tidal.data import load_dataset
    from tidal.demo.warm_start import prepare_base_model
    from tidal.roles import build_learner, trainer_weight_store
    from tidal.rundir import RunDir
    from tidal.trainer.boundary import publish_weights
    from tidal.weights import readable_manifest

    base = prepare_base_model(tiny_config, load_dataset(tiny_config.data, tiny_config.seed))
    learner, _ = build_learner(tiny_config, str(base))
    for loaded, name in ((True, "loaded"), (False, "shared")):
        store = trainer_weight_store(tiny_config, RunDir(tmp_path / name), str(base), learner, loaded_by_engines=loaded)
        publish_weights(store, 1, learner)
        manifest = readable_manifest(store.path(1))
        assert ("probe" in manifest) is loaded, name
        assert (store.probe is not None) is loaded, name
