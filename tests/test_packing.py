"""Shared-prompt packing must reproduce the naive layout's log-probs and gradients exactly (float32)."""

import random

import pytest
import torch

from tests.tiny_models import tiny_causal_lm
from tidal.trainer.packing import (
    dense_attention_mask,
    flex_attention_supported,
    group_num_tokens,
    length_buckets,
    naive_token_logprobs,
    pack_groups,
    packed_token_logprobs,
    resolve_kernel,
    scatter_rows,
    split_into_microbatches,
)

VOCAB = 64
EOS = 1
ATOL, RTOL = 1e-5, 1e-4
FLEX_GRAD_SKIP = pytest.mark.skipif(
    not flex_attention_supported("cpu", requires_grad=True),
    reason="FlexAttention unsupported on this device (no backward pass on CPU)",
)


def tiny_model(family: str) -> torch.nn.Module:
    model = tiny_causal_lm(family, VOCAB)
    model.config._attn_implementation = "sdpa"
    return model


@pytest.fixture(scope="module", params=["qwen2", "qwen2-mha", "qwen3", "llama"])
def model(request):
    return tiny_model(request.param)


def make_group(rng: random.Random, prompt_len: int, response_lens: list[int], eos: bool = False):
    prompt = [rng.randrange(2, VOCAB) for _ in range(prompt_len)]
    responses = []
    for length in response_lens:
        response = [rng.randrange(2, VOCAB) for _ in range(length)]
        if eos and response:
            response[-1] = EOS
        responses.append(response)
    return prompt, responses


def scenario(name: str):
    rng = random.Random(name)
    cases = {
        "G1_P1_R1": [make_group(rng, 1, [1])],
        "G2_P7_mixed_lengths": [make_group(rng, 7, [3, 1])],
        "G5_P30_eos": [make_group(rng, 30, [12, 1, 7, 20, 5], eos=True)],
        "G5_P1_len1_responses": [make_group(rng, 1, [1, 1, 1, 1, 1], eos=True)],
        "three_groups_one_microbatch": [
            make_group(rng, 1, [4, 1, 9, 2, 6], eos=True),
            make_group(rng, 7, [5, 11]),
            make_group(rng, 30, [8]),
        ],
        "groups_with_empty_response": [make_group(rng, 7, [0, 4]), make_group(rng, 3, [2, 0, 1])],
        # multi-turn trajectories: lengths ten times apart fall in several length buckets of the segmented kernel
        "lengths_ten_times_apart": [make_group(rng, 27, [12, 75, 3, 140, 16, 9], eos=True), make_group(rng, 5, [33, 2, 64])],
    }
    return cases[name]


SCENARIOS = [
    "G1_P1_R1",
    "G2_P7_mixed_lengths",
    "G5_P30_eos",
    "G5_P1_len1_responses",
    "three_groups_one_microbatch",
    "groups_with_empty_response",
    "lengths_ten_times_apart",
]


def fixed_weights(groups) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(1234)
    shapes = [(len(r), max((len(x) for x in r), default=0)) for _, r in groups]
    return [torch.randn(shape, generator=gen) for shape in shapes]


def loss_and_grads(model, outputs, weights):
    loss = sum((out.logprobs * w * out.mask).sum() for out, w in zip(outputs, weights, strict=True))
    model.zero_grad(set_to_none=True)
    loss.backward()
    return {name: p.grad.detach().clone() for name, p in model.named_parameters() if p.grad is not None}


def assert_outputs_match(packed_out, naive_out, check_entropy=False):
    assert len(packed_out) == len(naive_out)
    for packed, naive in zip(packed_out, naive_out, strict=True):
        assert packed.logprobs.shape == naive.logprobs.shape
        assert torch.equal(packed.mask, naive.mask)
        assert torch.all(packed.logprobs[~packed.mask] == 0)
        torch.testing.assert_close(packed.logprobs, naive.logprobs, atol=ATOL, rtol=RTOL)
        if check_entropy:
            torch.testing.assert_close(packed.entropy, naive.entropy, atol=ATOL, rtol=RTOL)


def check_packed_matches_naive(model, groups, kernel, temperature=1.0):
    weights = fixed_weights(groups)
    naive = naive_token_logprobs(model, groups, temperature=temperature, with_entropy=True)
    naive_grads = loss_and_grads(model, naive, weights)
    packed = packed_token_logprobs(model, pack_groups(groups), temperature, kernel=kernel, with_entropy=True)
    packed_grads = loss_and_grads(model, packed, weights)

    assert_outputs_match(packed, naive, check_entropy=True)
    assert naive_grads.keys() == packed_grads.keys()
    assert any(g.abs().sum() > 0 for g in naive_grads.values())
    for name, grad in naive_grads.items():
        torch.testing.assert_close(packed_grads[name], grad, atol=ATOL, rtol=RTOL, msg=lambda m, n=name: f"{n}: {m}")


@pytest.mark.parametrize("kernel", ["sdpa", "segmented"])
@pytest.mark.parametrize("name", SCENARIOS)
def test_matches_naive_logprobs_and_grads(model, name, kernel):
    check_packed_matches_naive(model, scenario(name), kernel=kernel)


@pytest.mark.parametrize("kernel", ["sdpa", "segmented"])
def test_matches_naive_with_temperature(model, kernel):
    check_packed_matches_naive(model, scenario("three_groups_one_microbatch"), kernel=kernel, temperature=0.7)


@pytest.mark.parametrize("kernel", ["sdpa", "segmented"])
def test_empty_response_row_is_masked(model, kernel):
    groups = scenario("groups_with_empty_response")
    with torch.no_grad():
        packed = packed_token_logprobs(model, pack_groups(groups), kernel=kernel)
        naive = naive_token_logprobs(model, groups)
    assert_outputs_match(packed, naive)
    assert not packed[0].mask[0].any() and not packed[1].mask[1].any()


@FLEX_GRAD_SKIP
@pytest.mark.parametrize("name", ["G5_P30_eos", "three_groups_one_microbatch"])
def test_flex_matches_naive_logprobs_and_grads(model, name):
    check_packed_matches_naive(model, scenario(name), kernel="flex")


@pytest.mark.skipif(not flex_attention_supported("cpu", requires_grad=False), reason="FlexAttention unsupported on this device")
def test_flex_forward_matches_naive_on_cpu():
    model = tiny_model("qwen2")
    groups = scenario("three_groups_one_microbatch")
    with torch.no_grad():
        packed = packed_token_logprobs(model, pack_groups(groups), kernel="flex")
        naive = naive_token_logprobs(model, groups)
    assert_outputs_match(packed, naive)


def test_packed_differs_from_plain_causal_packing(model):
    """Guard against a vacuous mask: ordinary causal attention over the packed row must NOT match."""
    groups = scenario("G5_P30_eos")
    packed = pack_groups(groups)
    with torch.no_grad():
        logits = model(input_ids=packed.input_ids, position_ids=packed.position_ids).logits[0, packed.logit_index]
        leaky = scatter_rows(torch.log_softmax(logits, -1).gather(-1, packed.target_ids[:, None])[:, 0], packed)  # one group's rows
        naive = naive_token_logprobs(model, groups)
    assert not torch.allclose(leaky, naive[0].logprobs, atol=1e-3)


def test_layout_of_one_group():
    packed = pack_groups([([10, 11], [[20, 21], [30]])])
    assert packed.input_ids.tolist() == [[10, 11, 20, 21, 30]]
    assert packed.position_ids.tolist() == [[0, 1, 2, 3, 2]]
    assert packed.logit_index.tolist() == [1, 2, 1]  # both first tokens read the prompt's last position
    assert packed.target_ids.tolist() == [20, 21, 30]
    expected = torch.tensor(
        [
            [1, 0, 0, 0, 0],
            [1, 1, 0, 0, 0],
            [1, 1, 1, 0, 0],
            [1, 1, 1, 1, 0],
            [1, 1, 0, 0, 1],
        ],
        dtype=torch.bool,
    )
    assert torch.equal(dense_attention_mask(packed)[0, 0], expected)


def test_groups_do_not_see_each_other():
    packed = pack_groups([([1], [[2]]), ([3, 4], [[5], [6]])])
    mask = dense_attention_mask(packed)[0, 0]
    assert not mask[2:, :2].any()
    assert packed.position_ids.tolist() == [[0, 1, 0, 1, 2, 2]]
    assert packed.logit_index.tolist() == [0, 3, 3]


def test_length_buckets_keep_each_longer_bucket_within_twice_its_shortest():
    lengths = [12, 75, 3, 140, 16, 9, 0, 1, 2, 64, 65]
    buckets = length_buckets(lengths)
    assert sorted(i for b in buckets for i in b) == list(range(len(lengths)))
    for b in buckets[1:]:
        assert max(lengths[i] for i in b) <= 2 * min(lengths[i] for i in b)
    # up to 16 tokens in one bucket, then by the power of two above each length, shortest first
    assert [sorted(lengths[i] for i in b) for b in buckets] == [[0, 1, 2, 3, 9, 12, 16], [64], [65, 75], [140]]


def test_unknown_kernel_raises():
    with pytest.raises(ValueError, match="unknown attention kernel"):
        resolve_kernel("flash9", "cpu")


def test_auto_kernel_on_cpu():
    assert resolve_kernel("auto", "cpu") == "segmented"


def test_kernel_restores_attention_implementation(model):
    packed_token_logprobs(model, pack_groups(scenario("G2_P7_mixed_lengths")), kernel="segmented")
    assert model.config._attn_implementation == "sdpa"


def test_empty_prompt_raises():
    with pytest.raises(ValueError, match="empty prompt"):
        pack_groups([([], [[1, 2]])])


def test_split_respects_token_budget_and_order():
    rng = random.Random(7)
    groups = [make_group(rng, rng.randint(1, 20), [rng.randint(0, 15) for _ in range(rng.randint(1, 5))]) for _ in range(40)]
    budget = 60
    microbatches = split_into_microbatches(groups, budget)
    assert [g for mb in microbatches for g in mb] == groups
    for mb in microbatches:
        total = sum(group_num_tokens(g) for g in mb)
        assert total <= budget or len(mb) == 1
        assert pack_groups(mb).num_tokens == total
    # greedy: the next micro-batch's first group would not have fit
    for mb, nxt in zip(microbatches, microbatches[1:]):
        assert sum(group_num_tokens(g) for g in mb) + group_num_tokens(nxt[0]) > budget


def test_split_puts_oversized_group_alone():
    small, big = ([1], [[2, 3]]), ([1] * 50, [[2] * 50])
    assert split_into_microbatches([small, big, small, small], 10) == [[small], [big], [small, small]]
    with pytest.raises(ValueError):
        split_into_microbatches([small], 0)


def multi_turn_groups(rng: random.Random):
    """Trajectories of sampled turns with inserted (environment / template) tokens between them:
    (prompt, responses, loss masks). Mask 0 runs sit between, before and after sampled runs."""

    def trajectory(runs):
        tokens, mask = [], []
        for sampled, length in runs:
            tokens += [rng.randrange(2, VOCAB) for _ in range(length)]
            mask += [int(sampled)] * length
        return tokens, mask

    def group(prompt_len, shapes):
        prompt = [rng.randrange(2, VOCAB) for _ in range(prompt_len)]
        responses, masks = zip(*(trajectory(runs) for runs in shapes))
        return prompt, list(responses), list(masks)

    return [
        group(5, [[(1, 3), (0, 4), (1, 2)], [(1, 1)], [(1, 2), (0, 3), (1, 4), (0, 2), (1, 1)]]),
        group(2, [[(0, 2), (1, 3)], [(1, 4), (0, 5)]]),
        group(9, [[(1, 6)], [(1, 2), (0, 1), (1, 2)], []]),
    ]


@pytest.mark.parametrize("kernel", ["sdpa", "segmented"])
def test_packed_multi_turn_batch_matches_one_sample_at_a_time(model, kernel):
    """A packed batch of multi-turn trajectories gives, on the sampled tokens, the log-probs and the
    gradient of a masked loss that each trajectory gives alone (prompt + trajectory, one row)."""
    groups = multi_turn_groups(random.Random("multi-turn"))
    weights = fixed_weights([g[:2] for g in groups])
    packed = packed_token_logprobs(model, pack_groups(groups), kernel=kernel)
    for out, (_, _, masks) in zip(packed, groups, strict=True):
        expected = torch.zeros_like(out.mask)
        for i, m in enumerate(masks):
            expected[i, : len(m)] = torch.tensor(m, dtype=torch.bool)
        assert torch.equal(out.loss_mask, expected) and torch.equal(out.trained, expected)
        assert (out.mask & ~out.loss_mask).any() or not any(0 in m for m in masks)
    packed_loss = sum((out.logprobs * w * out.loss_mask).sum() for out, w in zip(packed, weights))
    model.zero_grad(set_to_none=True)
    packed_loss.backward()
    packed_grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    alone_loss = 0.0
    for (prompt, responses, masks), out, w in zip(groups, packed, weights):
        for i, (response, mask) in enumerate(zip(responses, masks)):
            single = naive_token_logprobs(model, [(prompt, [response], [mask])])[0]
            trained = single.loss_mask[0]
            torch.testing.assert_close(out.logprobs[i, : len(response)][trained], single.logprobs[0][trained], atol=ATOL, rtol=RTOL)
            alone_loss = alone_loss + (single.logprobs[0] * w[i, : len(response)] * trained).sum()
    model.zero_grad(set_to_none=True)
    alone_loss.backward()
    for name, p in model.named_parameters():
        torch.testing.assert_close(packed_grads[name], p.grad, atol=ATOL, rtol=RTOL, msg=lambda m, n=name: f"{n}: {m}")


def test_a_loss_mask_must_match_its_response():
    with pytest.raises(ValueError, match="response 0: loss mask of 2 entries for 3 tokens"):
        pack_groups([([1], [[2, 3, 4]], [[1, 0]])])
    with pytest.raises(ValueError, match="1 loss masks for 2 responses"):
        pack_groups([([1], [[2], [3]], [[1]])])
    # without masks every response token is trained on
    assert pack_groups([([1], [[2, 3], [4]])]).loss_mask.tolist() == [True, True, True]
