"""The typed wire protocol: every message decoded from NATS is validated, and a bad one is a
ProtocolError naming the field, never a crash deeper in the trainer."""

import math

import msgpack
import numpy as np
import pytest

from tidal.protocol import (
    Group,
    GroupLimits,
    PolicyPointer,
    ProtocolError,
    RunState,
    RunStatus,
    Sample,
    WorkItem,
    decode_group,
    decode_work_item,
    pack,
    policy_pointer_from,
    run_status_from,
    unpack,
)

LIMITS = GroupLimits(vocab_size=100, max_new_tokens=6, group_size=2, newest_version=3, max_bytes=10_000)


def sample(tokens=(5, 6, 7), reward=1.0, **kw) -> Sample:
    t = np.asarray(tokens, dtype=np.int32)
    return Sample(t, kw.pop("logprobs", np.full(t.size, -0.5, dtype=np.float32)), reward, **kw)


def group(**kw) -> Group:
    fields = dict(
        iteration=3,
        prompt_id=11,
        policy_version=3,
        worker_id="w0",
        prompt_ids=np.array([1, 2], dtype=np.int32),
        samples=[sample(), sample(reward=0.0)],
    )
    fields.update(kw)
    return Group(**fields)


def wire(g: Group) -> dict:
    """The plain map a group travels as, to forge fields the dataclass would not hold."""
    return unpack(pack(g))


def test_a_valid_group_roundtrips_with_typed_arrays():
    g = decode_group(pack(group(samples=[sample(reward_parts={"exact_match": 1.0}, correct=1.0), sample(reward=0.0)])), LIMITS)
    assert g.iteration == 3 and g.policy_version == 3 and g.rewards == [1.0, 0.0]
    assert g.samples[0].token_ids.dtype == np.int32 and g.samples[0].logprobs.dtype == np.float32
    assert g.samples[0].reward_parts == {"exact_match": 1.0} and g.msg_id == "g-3-11"


def test_work_items_and_kv_values_roundtrip():
    item = WorkItem(2, 7, "1+1=", "2")
    assert decode_work_item(pack(item)) == item and item.msg_id == "w-2-7"
    assert policy_pointer_from(unpack(pack(PolicyPointer(4, "/w/v000004")))) == PolicyPointer(4, "/w/v000004")
    assert run_status_from(unpack(pack(RunStatus(RunState.ROUND_DONE, 1)))) == RunStatus(RunState.ROUND_DONE, 1)
    assert RunState.DONE.stops_workers and not RunState.RUNNING.stops_workers


def forged(change) -> bytes:
    data = wire(group())
    change(data)
    return msgpack.packb(data, default=lambda a: msgpack.ExtType(1, msgpack.packb([a.dtype.str, list(a.shape)]) + a.tobytes()), use_bin_type=True)


BAD = {
    "not msgpack": (b"\xc1\xc1garbage", "not a msgpack message"),
    "not a map": (msgpack.packb([1, 2, 3]), "expected a map"),
    "missing field": (forged(lambda d: d.pop("policy_version")), "missing field 'policy_version'"),
    "wrong type": (forged(lambda d: d.update(prompt_id="eleven")), "prompt_id: expected int, got str"),
    "bool for int": (forged(lambda d: d.update(iteration=True)), "expected int, got bool"),
    "token outside vocab": (pack(group(samples=[sample((5, 10**6)), sample()])), "token id 1000000 is outside the vocabulary"),
    "negative token": (pack(group(samples=[sample((5, -1)), sample()])), "token id -1 is outside the vocabulary"),
    "float tokens": (pack(group(samples=[Sample(np.array([1.5]), np.array([-1.0], dtype=np.float32), 1.0), sample()])), "1-D integer array"),
    "prompt outside vocab": (pack(group(prompt_ids=np.array([1, 500], dtype=np.int32))), "prompt_ids: token id 500"),
    "too many tokens": (pack(group(samples=[sample(range(1, 9)), sample()])), "8 tokens, more than max_new_tokens 6"),
    "nan log-prob": (pack(group(samples=[sample(logprobs=np.array([-0.1, np.nan, -0.2], dtype=np.float32)), sample()])), "logprobs: not finite"),
    "log-prob count": (pack(group(samples=[sample(logprobs=np.array([-0.1], dtype=np.float32)), sample()])), "expected 3 floats"),
    "nan reward": (pack(group(samples=[sample(reward=math.nan), sample()])), "reward is not finite"),
    "inf reward": (pack(group(samples=[sample(reward=math.inf), sample()])), "reward is not finite"),
    "string reward": (forged(lambda d: d["samples"][0].update(reward="0.5")), "reward: expected int or float, got str"),
    "future version": (pack(group(iteration=9, policy_version=9)), "policy_version 9 is from the future"),
    "newer than iteration": (pack(group(iteration=2, policy_version=3)), "newer than its iteration"),
    "wrong group size": (pack(group(samples=[sample()])), "1 samples, expected group_size 2"),
    "oversized": (pack(group(prompt_ids=np.ones(4000, dtype=np.int32))), "exceeds the 10000-byte limit"),
    "object array": (msgpack.packb({"x": msgpack.ExtType(1, msgpack.packb(["|O", [1]]) + b"\0" * 8)}), "Python objects"),
    "unknown extension": (msgpack.packb({"x": msgpack.ExtType(7, b"")}), "unknown msgpack extension type 7"),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_a_malformed_group_is_a_protocol_error_naming_what_is_wrong(case):
    payload, reason = BAD[case]
    with pytest.raises(ProtocolError, match=reason.replace("(", r"\(").replace(")", r"\)")):
        decode_group(payload, LIMITS)


def test_bad_work_items_and_run_states_are_protocol_errors():
    with pytest.raises(ProtocolError, match="work item: missing field 'answer'"):
        decode_work_item(msgpack.packb({"iteration": 0, "prompt_id": 1, "prompt": "x"}))
    with pytest.raises(ProtocolError, match="exceeds the 10-byte limit"):
        decode_work_item(pack(WorkItem(0, 1, "a long prompt", "1")), max_bytes=10)
    with pytest.raises(ProtocolError, match="unknown state 'paused'"):
        run_status_from({"state": "paused"})


def test_nothing_is_pickled():
    with pytest.raises(TypeError, match="cannot encode"):
        pack({"obj": object()})


# --- multi-turn trajectories: a loss mask over the response-side tokens -------------------------

TURNS = GroupLimits(vocab_size=100, max_new_tokens=3, max_turns=2, max_env_tokens_per_turn=2, group_size=2, newest_version=3)


def trajectory(mask=(1, 1, 0, 0, 1), logprobs=None, **kw) -> Sample:
    """Two turns (sampled tokens) with two inserted tokens between them."""
    mask = np.asarray(mask, dtype=np.uint8)
    tokens = np.arange(5, 5 + mask.size, dtype=np.int32)
    lp = np.where(mask == 1, -0.5, 0.0).astype(np.float32) if logprobs is None else np.asarray(logprobs, dtype=np.float32)
    return Sample(tokens, lp, 1.0, loss_mask=mask, **kw)


def test_a_trajectory_roundtrips_with_its_loss_mask():
    g = decode_group(pack(group(samples=[trajectory(), sample()])), TURNS)
    traj, single = g.samples
    assert traj.loss_mask.dtype == np.uint8 and traj.loss_mask.tolist() == [1, 1, 0, 0, 1]
    assert traj.trained_mask().tolist() == [True, True, False, False, True] and traj.sampled_tokens == 3
    assert single.loss_mask is None and single.trained_mask().all() and single.sampled_tokens == 3


def test_an_inserted_token_needs_no_log_prob():
    """Whatever an inserted token carries (even nan) is dropped to 0; only sampled ones are checked."""
    g = decode_group(pack(group(samples=[trajectory(logprobs=[-0.1, -0.2, np.nan, np.inf, -0.3]), sample()])), TURNS)
    assert g.samples[0].logprobs.tolist() == pytest.approx([-0.1, -0.2, 0.0, 0.0, -0.3])
    with pytest.raises(ProtocolError, match=r"samples\[0\].logprobs: not finite"):
        decode_group(pack(group(samples=[trajectory(logprobs=[-0.1, np.nan, 0.0, 0.0, -0.3]), sample()])), TURNS)


def test_a_single_turn_message_is_unchanged_on_the_wire():
    """No loss mask: the field is left off, so single-turn groups keep their bytes, and a message
    written without the field (every existing one) decodes as all ones."""
    plain = group()
    assert set(wire(plain)["samples"][0]) == {"token_ids", "logprobs", "reward", "finish_reason", "reward_parts", "correct"}
    with_mask = group(samples=[sample(loss_mask=np.ones(3, dtype=np.uint8)), sample(loss_mask=np.ones(3, dtype=np.uint8))])
    assert len(pack(with_mask)) > len(pack(plain))
    assert decode_group(pack(plain), LIMITS).samples[0].loss_mask is None


def forged_trajectory(change) -> bytes:
    data = wire(group(samples=[trajectory(), trajectory()]))
    change(data["samples"][0])
    return msgpack.packb(data, default=lambda a: msgpack.ExtType(1, msgpack.packb([a.dtype.str, list(a.shape)]) + a.tobytes()), use_bin_type=True)


BAD_TRAJECTORIES = {
    "mask length": (forged_trajectory(lambda s: s.update(loss_mask=np.ones(4, dtype=np.uint8))), "loss_mask: 4 entries for 5 tokens"),
    "mask values": (forged_trajectory(lambda s: s.update(loss_mask=np.array([1, 2, 0, 0, 1], dtype=np.uint8))), "values must be 0 or 1, found [2]"),
    "float mask": (forged_trajectory(lambda s: s.update(loss_mask=np.ones(5, dtype=np.float32))), "loss_mask: expected a 1-D integer array"),
    "list mask": (forged_trajectory(lambda s: s.update(loss_mask=[1, 1, 0, 0, 1])), "loss_mask: expected a 1-D integer array of 0/1, got list"),
    "too many turns": (pack(group(samples=[trajectory((1, 0, 1, 0, 1)), trajectory()])), "3 turns, more than max_turns 2"),
    "too many sampled": (
        pack(group(samples=[trajectory((1, 1, 1, 1, 0, 1, 1, 1)), trajectory()])),
        "7 sampled tokens, more than max_turns x max_new_tokens",
    ),
    "too many inserted": (pack(group(samples=[trajectory((1, 1, 1, 0, 0, 0, 1, 1, 1)), trajectory()])), "9 tokens, more than 2 turns"),
}


@pytest.mark.parametrize("case", sorted(BAD_TRAJECTORIES))
def test_a_malformed_trajectory_is_a_protocol_error_naming_what_is_wrong(case):
    payload, reason = BAD_TRAJECTORIES[case]
    with pytest.raises(ProtocolError, match=reason.replace("[", r"\[").replace("]", r"\]")):
        decode_group(payload, TURNS)


def test_single_turn_limits_apply_to_a_masked_sample_too():
    """With max_turns 1 (no environment), a masked sample is held to max_new_tokens like any other."""
    with pytest.raises(ProtocolError, match="7 tokens, more than max_new_tokens 6"):
        decode_group(pack(group(samples=[trajectory((1, 1, 1, 0, 1, 1, 1)), sample()])), LIMITS)


def test_a_groups_environment_counts_roundtrip_and_are_checked():
    g = decode_group(pack(group(env_stats={"trajectories": 2, "tool_calls": 3.0})), LIMITS)
    assert g.env_stats == {"trajectories": 2.0, "tool_calls": 3.0}
    assert "env_stats" not in wire(group()) and decode_group(pack(group()), LIMITS).env_stats is None
    for stats, reason in [
        ({"tool_calls": -1}, r"env_stats\['tool_calls'\]: -1 is not a finite count"),
        ({"tool_calls": math.nan}, "is not a finite count"),
        ({"tool_calls": "3"}, "expected name -> number, got 'tool_calls': str"),
        ({f"k{i}": 1 for i in range(65)}, "expected a map of at most 64 named numbers"),
    ]:
        with pytest.raises(ProtocolError, match=reason):
            decode_group(pack(group(env_stats=stats)), LIMITS)
