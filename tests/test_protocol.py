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
