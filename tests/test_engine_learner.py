"""Real forward/backward passes of a tiny model built from a config."""

import copy

import numpy as np
import pytest
import torch

from tests.conftest import eos_prone
from tidal.algo import token_logprobs_from_logits
from tidal.config import TinyModelConfig, TrainerConfig
from tidal.demo.tiny import build_char_tokenizer, build_tiny_model
from tidal.rollout.engine import GroupRequest, HFEngine, group_generator
from tidal.trainer.learner import Learner


def tiny():
    torch.manual_seed(0)
    tok = build_char_tokenizer()
    model = build_tiny_model(TinyModelConfig(hidden_size=32, intermediate_size=64, num_layers=2, num_heads=2, num_kv_heads=1), tok)
    return model.eval(), tok


def engine_for(model, tok, temperature=1.0):
    return HFEngine(model, tok.eos_token_id, tok.pad_token_id, max_new_tokens=6, temperature=temperature)


def test_char_tokenizer_roundtrips():
    tok = build_char_tokenizer()
    text = "12+34=\nA: 46"
    assert tok.decode(tok(text, add_special_tokens=False).input_ids) == text


def test_group_samples_depend_only_on_seed_iteration_prompt():
    model, tok = tiny()
    eng = engine_for(model, tok)
    p1, p2 = tok("12+3=").input_ids, tok("7-88=").input_ids
    alone = eng.generate([GroupRequest(p1, 4, group_generator(0, 2, 11))])[0]
    again = eng.generate([GroupRequest(p1, 4, group_generator(0, 2, 11))])[0]
    batched = eng.generate([GroupRequest(p2, 4, group_generator(0, 2, 12)), GroupRequest(p1, 4, group_generator(0, 2, 11))])[1]
    other = eng.generate([GroupRequest(p1, 4, group_generator(0, 3, 11))])[0]
    assert [s.token_ids for s in alone] == [s.token_ids for s in again] == [s.token_ids for s in batched]
    assert [s.token_ids for s in alone] != [s.token_ids for s in other]


def test_engine_logprobs_match_a_trainer_forward():
    model, tok = tiny()
    for temperature in (1.0, 0.7):
        eng = engine_for(model, tok, temperature)
        prompt = tok("45+67=").input_ids
        samples = eng.generate([GroupRequest(prompt, 3, group_generator(1, 0, 0))])[0]
        for s in samples:
            ids = torch.tensor([prompt + s.token_ids])
            logits = model(input_ids=ids).logits[:, len(prompt) - 1 : -1]
            ref = token_logprobs_from_logits(logits, ids[:, len(prompt) :], temperature)[0][0]
            assert torch.allclose(ref, torch.tensor(s.logprobs), atol=1e-4)
            assert s.finish_reason in ("stop", "length")
            assert (s.finish_reason == "stop") == (s.token_ids[-1] == tok.eos_token_id)


def test_rows_that_finish_early_leave_the_batch_without_changing_any_sample():
    """The engine prefills each prompt once and drops rows after EOS: every emitted token's log-prob
    still equals a full forward over prompt + completion, whatever the prompt lengths (left padding),
    group sizes and finishing steps in one call, and a group's samples are the same alone or batched."""
    model, tok = tiny()
    model = eos_prone(model, tok, eos_logit=3.0)
    eng = engine_for(model, tok)
    prompts = [tok(t).input_ids for t in ("1+2=", "45+67=", "123+456=")]
    requests = lambda: [GroupRequest(p, n, group_generator(3, 1, i)) for i, (p, n) in enumerate(zip(prompts, (5, 2, 7)))]
    batched = eng.generate(requests())
    lengths = [len(s.token_ids) for group in batched for s in group]
    assert min(lengths) < eng.max_new_tokens and max(lengths) == eng.max_new_tokens  # rows did finish at different steps
    assert {s.finish_reason for group in batched for s in group} == {"stop", "length"}
    for prompt, group in zip(prompts, batched):
        for s in group:
            ids = torch.tensor([prompt + s.token_ids])
            logits = model(input_ids=ids).logits[:, len(prompt) - 1 : -1]
            ref = token_logprobs_from_logits(logits, ids[:, len(prompt) :])[0][0]
            assert torch.allclose(ref, torch.tensor(s.logprobs), atol=1e-4)
            assert (s.finish_reason == "stop") == (s.token_ids[-1] == tok.eos_token_id)
            assert tok.eos_token_id not in s.token_ids[:-1]
    for i, request in enumerate(requests()):
        alone = eng.generate([request])[0]
        assert [s.token_ids for s in alone] == [s.token_ids for s in batched[i]]


def make_group(rng, prompt_len, lengths, rewards, policy_version=0):
    from tidal.protocol import Group, Sample

    samples = []
    for n, r in zip(lengths, rewards):
        samples.append(Sample(np.asarray(rng.integers(4, 90, n), dtype=np.int32), np.zeros(n, dtype=np.float32), r))
    return Group(0, 0, policy_version, "test", np.asarray(rng.integers(4, 90, prompt_len), dtype=np.int32), samples)


def test_streaming_accumulation_equals_the_batch_token_mean_gradient():
    """Loss normalisation under streaming (docs/design.md §3.2): sum per group, scale by 1/N_total at the step == token-mean over the whole batch."""
    rng = np.random.default_rng(0)
    groups = [make_group(rng, 5, [3, 1, 6], [1.0, 0.0, 0.0]), make_group(rng, 2, [4, 4, 2], [0.0, 1.0, 1.0])]
    model, tok = tiny()
    cfg = TrainerConfig(lr=1e-3, max_grad_norm=1e9, warmup_steps=0)
    learner = Learner(cfg, copy.deepcopy(model), tok.pad_token_id)
    for g in reversed(groups):  # completion order differs from prompt order
        learner.train_on_group(g)
    n_total = learner.tokens
    streamed = {n: p.grad.clone() / n_total for n, p in learner.model.named_parameters() if p.grad is not None}

    ref = copy.deepcopy(model).train()
    total, count = 0.0, 0
    from tidal.algo import grpo_advantages

    for g in groups:
        prompt = g.prompt_ids.tolist()
        for r, adv in zip(g.samples, grpo_advantages(torch.tensor(g.rewards))):
            ids = torch.tensor([prompt + r.token_ids.tolist()])
            logits = ref(input_ids=ids).logits[:, len(prompt) - 1 : -1]
            logp = token_logprobs_from_logits(logits, ids[:, len(prompt) :])[0]
            total = total + (-adv * torch.exp(logp - logp.detach())).sum()
            count += logp.numel()
    (total / count).backward()
    assert count == n_total
    for n, p in ref.named_parameters():
        if p.grad is not None:
            assert torch.allclose(streamed[n], p.grad, atol=1e-6), n


def test_zero_advantage_groups_count_tokens_but_add_no_gradient():
    rng = np.random.default_rng(1)
    model, tok = tiny()
    learner = Learner(TrainerConfig(), model, tok.pad_token_id)
    assert learner.reference is None  # no reference weights at all when kl_coef is 0
    learner.train_on_group(make_group(rng, 3, [2, 5], [1.0, 1.0]))
    assert learner.tokens == 7
    assert all(p.grad is None for p in model.parameters())
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    metrics = learner.step()
    assert metrics["trained_tokens"] == 7.0
    assert all(torch.equal(before[n], p) for n, p in model.named_parameters())


def test_kl_term_uses_a_frozen_reference():
    rng = np.random.default_rng(2)
    model, tok = tiny()
    learner = Learner(TrainerConfig(kl_coef=0.1, lr=1e-2, warmup_steps=0), model, tok.pad_token_id)
    g = make_group(rng, 3, [4, 4], [1.0, 0.0])
    learner.train_on_group(g)
    assert learner.step()["kl"] == 0.0  # identical weights on the first step
    learner.train_on_group(g)
    m = learner.step()
    assert m["kl"] > 0.0 and all(not p.requires_grad for p in learner.reference.parameters())


def test_one_update_per_iteration_has_no_old_policy_and_ratio_exactly_one():
    from tidal.config import config_from_dict
    from tidal.trainer.loop import IterationUpdates

    rng = np.random.default_rng(3)
    model, tok = tiny()
    cfg = config_from_dict({"trainer": {"prompts_per_iteration": 2}})
    learner = Learner(cfg.trainer, model, tok.pad_token_id)
    assert learner.old_policy is None and learner.reference is None
    updates = IterationUpdates(learner, cfg, 0)
    updates.add([make_group(rng, 3, [2, 5, 3], [1.0, 0.0, 0.0]), make_group(rng, 4, [3, 3], [0.0, 1.0])])
    metrics = updates.finish()
    assert metrics["ratio_max"] == 1.0 and metrics["optimizer_steps"] == 1.0
    assert learner.forwards == {"policy": 1, "old": 0, "reference": 0}  # two groups packed in one micro-batch


def test_several_updates_per_iteration_use_the_generating_policy_as_old():
    from tidal.config import config_from_dict
    from tidal.trainer.loop import IterationUpdates

    rng = np.random.default_rng(4)
    model, tok = tiny()
    initial = {k: v.clone() for k, v in model.state_dict().items()}
    cfg = config_from_dict({"trainer": {"prompts_per_iteration": 2, "updates_per_iteration": 2, "lr": 1e-2, "warmup_steps": 0}})
    learner = Learner(cfg.trainer, model, tok.pad_token_id)
    updates = IterationUpdates(learner, cfg, 0)
    updates.add([make_group(rng, 3, [4, 4, 4], [1.0, 0.0, 0.0])])
    assert len(updates.updates) == 1  # the first mini-batch stepped already
    assert any(not torch.equal(initial[k], v) for k, v in model.state_dict().items())
    assert all(torch.equal(initial[k], v) for k, v in learner.old_policy.state_dict().items())  # old = generating weights
    updates.add([make_group(rng, 3, [4, 4, 4], [0.0, 1.0, 0.0])])
    metrics = updates.finish()
    assert metrics["optimizer_steps"] == 2.0
    assert metrics["ratio_max"] != 1.0  # the second mini-batch sees pi_theta / pi_old != 1
    assert learner.forwards["old"] == 2  # old log-probs computed once per group, never recomputed


def test_truncated_importance_sampling_against_engine_logprobs():
    rng = np.random.default_rng(5)
    model, tok = tiny()
    learner = Learner(TrainerConfig(tis_cap=1.5), model, tok.pad_token_id)
    g = make_group(rng, 3, [4, 4], [1.0, 0.0])
    for r in g.samples:
        r.logprobs = np.full(len(r.token_ids), -20.0, dtype=np.float32)  # an engine far off the trainer
    learner.train_on_groups([g])
    m = learner.step()
    assert m["logprob_mismatch"] > 5.0 and m["tis_truncated_fraction"] == 1.0


def test_reference_can_be_offloaded_to_cpu():
    model, tok = tiny()
    learner = Learner(TrainerConfig(kl_coef=0.05, reference_device="cpu"), model, tok.pad_token_id)
    assert all(p.device.type == "cpu" and not p.requires_grad for p in learner.reference.parameters())


def test_a_saved_tiny_model_reloads_with_the_same_tokenizer(tmp_path):
    """AutoTokenizer would swap in Qwen2's pre-tokenizer and silently drop spaces."""
    from tidal.model.loading import load_model_and_tokenizer

    model, tok = tiny()
    model.save_pretrained(tmp_path)
    tok.save_pretrained(tmp_path)
    _, loaded = load_model_and_tokenizer(tmp_path)
    text = "12+34=\nA: 46"
    assert loaded(text, add_special_tokens=False).input_ids == tok(text, add_special_tokens=False).input_ids
    assert loaded.decode(tok(text, add_special_tokens=False).input_ids) == text


def test_held_out_sampled_accuracy_is_seeded_per_prompt_and_scores_every_sample():
    from tidal.data import Problem
    from tidal.evaluate import held_out_accuracy

    model, tok = tiny()
    eng = engine_for(model, tok)
    problems = [Problem(i, f"{i}+1=", str(i + 1)) for i in range(6)]
    first = held_out_accuracy(eng, tok, problems, batch_size=4, samples=3, seed=5)
    # another batch size, the same per-prompt noise: the same samples, so the same score
    assert held_out_accuracy(eng, tok, problems, batch_size=2, samples=3, seed=5) == first

    class Answers:
        """An engine that answers the first prompt right in 1 of its 3 samples and the rest wrong."""

        def generate(self, requests, greedy=False, max_new_tokens=None):
            from tidal.rollout.engine import Completion

            def text(i, j):
                return "A: 1" if (i, j) == (0, 0) else "A: 7"

            return [
                [Completion(tok(text(i, j), add_special_tokens=False).input_ids, [0.0], "stop") for j in range(r.n)] for i, r in enumerate(requests)
            ]

    assert held_out_accuracy(Answers(), tok, problems[:2], batch_size=8, samples=3) == 1 / 6


def test_learning_diagnostics_count_groups_without_signal_and_solved_prompts():
    from tidal.trainer.metrics import learning_diagnostics

    rng = np.random.default_rng(9)
    flat = make_group(rng, 3, [2, 2], [0.1, 0.1])  # all equal: no signal
    mixed = make_group(rng, 3, [4, 6], [1.0, 0.0])
    mixed.samples[0].correct = 1.0
    d = learning_diagnostics([flat, mixed])
    assert d["zero_advantage_group_fraction"] == 0.5 and d["pass_at_group_size"] == 0.5
    assert d["response_length_correct_mean"] == 4.0 and d["response_length_incorrect_mean"] == (2 + 2 + 6) / 3


def test_pipeline_efficiency_is_the_slower_phase_plus_sync_over_the_iteration():
    from tidal.trainer.metrics import generation_tail, pipeline_efficiency

    assert pipeline_efficiency(generate=2.0, train=1.0, sync=0.5, iteration=2.5) == 1.0  # perfect overlap
    assert pipeline_efficiency(generate=2.0, train=1.0, sync=0.0, iteration=3.0) == pytest.approx(2 / 3)  # serial
    rng = np.random.default_rng(3)
    groups = [make_group(rng, 2, [1], [0.0]) for _ in range(3)]
    for g, end in zip(groups, (5.0, 7.5, 6.0)):
        g.gen_start, g.gen_end = 1.0, end
    assert generation_tail(groups) == 2.5 and generation_tail([]) == 0.0
