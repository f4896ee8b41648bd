"""The messages between roles, declared once: work items, groups, run states, KV keys, one codec.

Everything that crosses a process boundary is msgpack (numpy arrays as a typed binary extension),
never pickle. Every decode validates: a message with a missing field, a wrong type, a token id
outside the vocabulary, more tokens than `max_new_tokens` (or, for a multi-turn trajectory, more
turns or tokens than its limits allow), a loss mask that is not one 0/1 per token, a non-finite
log-prob on a sampled token or a non-finite reward, a version from the future (or per-token versions
that do not cover the tokens or leave the group's window) or an oversized payload raises `ProtocolError` naming what is wrong, and the caller rejects it (terminates it,
counts it, logs it); it never reaches the loss.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from enum import Enum, StrEnum
from typing import Any

import msgpack
import numpy as np

from tidal.images import ImageInputs, image_bytes_from, image_inputs_from
from tidal.token_versions import NO_VERSION, VersionRunsError, decode_runs, encode_runs
from tidal.tool_rates import tool_use_rates  # noqa: F401 - its old home

_NDARRAY_EXT = 1

# A role's exit code when NATS cannot be reached (EX_TEMPFAIL): the launcher may restart it.
NATS_LOST_EXIT = 75
WEIGHTS_DID_NOT_ARRIVE_EXIT = 76  # a rollout worker's engine computes with other weights than the trainer published: not restarted
REWARD_SERVER_FAILED_EXIT = 77  # a reward (served or a function) failed more than its max_error_rate: not restarted


class ProtocolError(ValueError):
    """A message that does not match its declared type; the text says which field and why."""


# --- run state and KV keys ---------------------------------------------------------------------


class RunState(StrEnum):
    RUNNING = "running"
    ROUND_DONE = "round_done"  # a pipeline round is over; the next round starts new workers
    DONE = "done"
    FAILED = "failed"
    STOPPED = "stopped"  # the launcher was stopped (SIGINT, SIGTERM): a re-run resumes at the last boundary

    @property
    def stops_workers(self) -> bool:
        return self is not RunState.RUNNING


class KVKey:
    """Keys of the run's KV bucket."""

    POLICY = "policy"  # PolicyPointer: the newest published weights
    RUN = "run"  # RunStatus
    NCCL = "weight_sync.nccl"  # the NCCL weight-transfer handshake (transport/weight_handshake.py)
    NCCL_READY_PREFIX = "weight_sync.ready."
    NCCL_REFUSED = "weight_sync.refused"  # a worker's reason the NCCL transfer cannot go on; only the trainer writes NCCL

    WORKERS_PREFIX = "workers."

    @staticmethod
    def worker(worker_id: str) -> str:  # a worker's heartbeat (tidal.transport.health)
        return f"{KVKey.WORKERS_PREFIX}{worker_id}"


# --- messages ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class WorkItem:
    """One prompt of iteration `iteration`, to be answered with one group."""

    iteration: int
    prompt_id: int
    prompt: str
    answer: str
    images: list[bytes] | None = None  # the prompt's encoded image files; None (left off the wire): text only

    @property
    def msg_id(self) -> str:  # JetStream de-duplication: a re-published item is stored once
        return f"w-{self.iteration}-{self.prompt_id}"


@dataclass
class Sample:
    """One response: its tokens, the engine's (behaviour) log-prob of each, and its reward.

    A multi-turn trajectory is one sample: `token_ids` holds every token after the prompt, across
    turns, and `loss_mask` says which of them the policy sampled (1) and which the environment or
    the chat template inserted (0). Only sampled tokens are trained on and need a log-prob (the
    others carry 0). A single-turn response is the one-turn case: no mask, every token sampled;
    the field is then left off the wire, so single-turn messages are as they always were."""

    token_ids: np.ndarray  # int32 [T]
    logprobs: np.ndarray  # float32 [T]; 0 where loss_mask is 0
    reward: float
    finish_reason: str = ""
    reward_parts: dict[str, float] = field(default_factory=dict)
    correct: float = 0.0
    loss_mask: np.ndarray | None = None  # uint8 [T], 1 = sampled by the policy; None: all ones
    # int32 [T]: the version that sampled each token (tidal.token_versions); None: all the group's policy_version
    versions: np.ndarray | None = None

    def token_versions(self, group_version: int) -> np.ndarray:
        """int32 [T]: each token's sampling version (NO_VERSION where inserted)."""
        return self.versions if self.versions is not None else np.where(self.trained_mask(), group_version, NO_VERSION).astype(np.int32)

    def trained_mask(self) -> np.ndarray:
        """bool [T]: the tokens the policy sampled, the only ones trained on."""
        if self.loss_mask is None:
            return np.ones(self.token_ids.size, dtype=bool)
        return self.loss_mask.astype(bool)

    @property
    def sampled_tokens(self) -> int:
        return int(self.token_ids.size if self.loss_mask is None else np.count_nonzero(self.loss_mask))


@dataclass
class Group:
    """One work item answered: G samples of one prompt, generated by weights `policy_version` (with
    partial rollouts: the oldest version among its tokens, which staleness is measured by)."""

    iteration: int
    prompt_id: int
    policy_version: int
    worker_id: str
    prompt_ids: np.ndarray  # int32 [P]
    samples: list[Sample]
    gen_start: float = 0.0
    gen_end: float = 0.0
    reward_errors: int = 0
    weight_load_seconds: float = 0.0
    worker_idle_seconds: float = 0.0
    # multi-turn rollouts: the environment's counts summed over the group's trajectories (turns,
    # tool calls, tool errors, ...); None (left off the wire) for single-turn groups
    env_stats: dict[str, float] | None = None
    # scoring: seconds spent and the served rewards' request counts (tidal.rewards.served), for the
    # engine call this group came from (on its first group); None (left off the wire) otherwise
    reward_stats: dict[str, float] | None = None
    # calls and failures per reward (and environment step() / reward()) since the worker's last group:
    # name -> [calls, failed, the first failure's text] (tidal.rewards.failures); None (left off the wire) when none were made
    failures: dict[str, list] | None = None
    images: ImageInputs | None = None  # the prompt's processed images, once for all samples; None (left off the wire): text only

    @property
    def msg_id(self) -> str:
        return f"g-{self.iteration}-{self.prompt_id}"

    @property
    def rewards(self) -> list[float]:
        return [s.reward for s in self.samples]


@dataclass(frozen=True)
class PolicyPointer:
    """KV `policy`: the newest published weights and where they are."""

    version: int
    uri: str


@dataclass(frozen=True)
class RunStatus:
    """KV `run`: the run's state, and the pipeline round it belongs to (None locally)."""

    state: RunState
    round: int | None = None


@dataclass(frozen=True)
class GroupLimits:
    """What a group may contain, from the trainer's model and config. None: not checked."""

    vocab_size: int | None = None
    max_new_tokens: int | None = None  # sampled tokens per turn
    max_turns: int = 1  # assistant turns per trajectory
    max_env_tokens_per_turn: int = 0  # tokens the environment and template insert after a turn
    group_size: int | None = None
    newest_version: int | None = None  # a policy version above this is from the future
    max_bytes: int | None = None


# --- codec -------------------------------------------------------------------------------------


def _default(obj):
    if isinstance(obj, np.ndarray):
        header = msgpack.packb([obj.dtype.str, list(obj.shape)])
        return msgpack.ExtType(_NDARRAY_EXT, header + np.ascontiguousarray(obj).tobytes())
    if isinstance(obj, np.generic):
        return obj.item()
    if isinstance(obj, Enum):
        return obj.value
    raise TypeError(f"cannot encode {type(obj).__name__} (only msgpack types and numpy arrays cross processes)")


def _ext_hook(code: int, data: bytes):
    if code != _NDARRAY_EXT:
        raise ProtocolError(f"unknown msgpack extension type {code}")
    unpacker = msgpack.Unpacker()
    unpacker.feed(data)
    dtype, shape = next(unpacker)
    offset = unpacker.tell()
    dtype = np.dtype(dtype)
    if dtype.hasobject:
        raise ProtocolError("an array of Python objects cannot cross processes")
    return np.frombuffer(data, dtype=dtype, offset=offset).reshape(shape)


# Optional fields left off the wire when unset, so messages that do not use them keep their size and
# older readers' view of them (a single-turn sample has no loss mask).
_OMITTED_WHEN_NONE = frozenset({"loss_mask", "versions", "env_stats", "reward_stats", "failures", "images"})
_MAX_ENV_STATS, _MAX_ERROR_CHARS = 64, 1000  # named counts a group may carry; characters of a failure's text


def _fields(pairs: list[tuple[str, Any]]) -> dict:
    out = {k: v for k, v in pairs if not (v is None and k in _OMITTED_WHEN_NONE)}
    if "versions" in out:  # a sample's per-token versions travel as runs
        out["version_runs"] = encode_runs(out.pop("versions"))
    return out


def pack(obj: Any) -> bytes:
    """msgpack bytes of a message dataclass, or of plain msgpack data."""
    if hasattr(obj, "__dataclass_fields__"):
        obj = asdict(obj, dict_factory=_fields)
    return msgpack.packb(obj, default=_default, use_bin_type=True)


def unpack(data: bytes, max_bytes: int | None = None) -> Any:
    """Plain data from msgpack bytes; a payload that is too large or not msgpack is a ProtocolError."""
    if max_bytes is not None and len(data) > max_bytes:
        raise ProtocolError(f"payload of {len(data)} bytes exceeds the {max_bytes}-byte limit")
    try:
        return msgpack.unpackb(data, ext_hook=_ext_hook, raw=False, strict_map_key=False)
    except ProtocolError:
        raise
    except Exception as err:  # noqa: BLE001 - msgpack raises several unrelated types on garbage
        raise ProtocolError(f"not a msgpack message ({type(err).__name__}: {err})") from None


# --- validation helpers ------------------------------------------------------------------------


def _mapping(data: Any, what: str) -> dict:
    if not isinstance(data, dict):
        raise ProtocolError(f"{what}: expected a map, got {type(data).__name__}")
    return data


def _get(data: dict, key: str, kinds: type | tuple[type, ...], what: str, default: Any = ...) -> Any:
    if key not in data:
        if default is ...:
            raise ProtocolError(f"{what}: missing field {key!r}")
        return default
    value = data[key]
    # bool is an int subclass in Python; a boolean where a number is declared is a wrong type
    if isinstance(value, bool) and bool not in (kinds if isinstance(kinds, tuple) else (kinds,)):
        raise ProtocolError(f"{what}.{key}: expected {_names(kinds)}, got bool")
    if not isinstance(value, kinds):
        raise ProtocolError(f"{what}.{key}: expected {_names(kinds)}, got {type(value).__name__}")
    return value


def _names(kinds) -> str:
    return " or ".join(k.__name__ for k in (kinds if isinstance(kinds, tuple) else (kinds,)))


def _finite(value: float, what: str) -> float:
    value = float(value)
    if not math.isfinite(value):
        raise ProtocolError(f"{what} is not finite ({value})")
    return value


def _token_array(value: Any, what: str, vocab_size: int | None) -> np.ndarray:
    if not isinstance(value, np.ndarray) or value.ndim != 1 or value.dtype.kind not in "iu":
        raise ProtocolError(f"{what}: expected a 1-D integer array, got {_describe(value)}")
    if value.size and vocab_size is not None and (int(value.min()) < 0 or int(value.max()) >= vocab_size):
        bad = int(value.max()) if int(value.max()) >= vocab_size else int(value.min())
        raise ProtocolError(f"{what}: token id {bad} is outside the vocabulary [0, {vocab_size})")
    if value.size and vocab_size is None and int(value.min()) < 0:
        raise ProtocolError(f"{what}: negative token id {int(value.min())}")
    return value.astype(np.int32, copy=False)


def _describe(value: Any) -> str:
    if isinstance(value, np.ndarray):
        return f"a {value.ndim}-D {value.dtype} array"
    return type(value).__name__


# --- typed decoders ----------------------------------------------------------------------------


def work_item_from(data: Any) -> WorkItem:
    d = _mapping(data, "work item")
    item = WorkItem(
        iteration=_get(d, "iteration", int, "work item"),
        prompt_id=_get(d, "prompt_id", int, "work item"),
        prompt=_get(d, "prompt", str, "work item"),
        answer=_get(d, "answer", str, "work item"),
        images=image_bytes_from(d.get("images"), "work item.images", ProtocolError),
    )
    if item.iteration < 0:
        raise ProtocolError(f"work item: negative iteration {item.iteration}")
    return item


def decode_work_item(data: bytes, max_bytes: int | None = None) -> WorkItem:
    return work_item_from(unpack(data, max_bytes))


def _loss_mask(value: Any, what: str, size: int) -> np.ndarray | None:
    if value is None:
        return None
    if not isinstance(value, np.ndarray) or value.ndim != 1 or value.dtype.kind not in "iub":
        raise ProtocolError(f"{what}: expected a 1-D integer array of 0/1, got {_describe(value)}")
    if value.size != size:
        raise ProtocolError(f"{what}: {value.size} entries for {size} tokens (one per token)")
    if value.size and not np.isin(value, (0, 1)).all():
        raise ProtocolError(f"{what}: values must be 0 or 1, found {sorted(set(value.tolist()) - {0, 1})[:3]}")
    return value.astype(np.uint8, copy=False)


def _turns(mask: np.ndarray) -> int:
    """Runs of sampled tokens: each assistant turn is one (two turns are never adjacent: the
    environment or the template inserts tokens between them)."""
    if not mask.size:
        return 0
    starts = mask[1:].astype(bool) & ~mask[:-1].astype(bool)
    return int(mask[0]) + int(np.count_nonzero(starts))


def _check_lengths(tokens: np.ndarray, mask: np.ndarray | None, what: str, limits: GroupLimits) -> None:
    """Single-turn: at most max_new_tokens. Multi-turn: at most max_turns turns, max_new_tokens
    sampled tokens per turn, and max_env_tokens_per_turn inserted tokens between turns."""
    if limits.max_new_tokens is None:
        return
    if mask is None or limits.max_turns == 1:
        if tokens.size > limits.max_new_tokens:
            raise ProtocolError(f"{what}.token_ids: {tokens.size} tokens, more than max_new_tokens {limits.max_new_tokens}")
        return
    turns, sampled = _turns(mask), int(np.count_nonzero(mask))
    if turns > limits.max_turns:
        raise ProtocolError(f"{what}.loss_mask: {turns} turns, more than max_turns {limits.max_turns}")
    if sampled > limits.max_turns * limits.max_new_tokens:
        raise ProtocolError(
            f"{what}.loss_mask: {sampled} sampled tokens, more than max_turns x max_new_tokens ({limits.max_turns} x {limits.max_new_tokens})"
        )
    most = limits.max_turns * limits.max_new_tokens + (limits.max_turns - 1) * limits.max_env_tokens_per_turn
    if tokens.size > most:
        raise ProtocolError(
            f"{what}.token_ids: {tokens.size} tokens, more than {limits.max_turns} turns of max_new_tokens {limits.max_new_tokens} "
            f"and max_env_tokens_per_turn {limits.max_env_tokens_per_turn} between them allow ({most})"
        )


def _sample_from(data: Any, what: str, limits: GroupLimits, window: tuple[int, int]) -> Sample:
    d = _mapping(data, what)
    tokens = _token_array(_get(d, "token_ids", np.ndarray, what), f"{what}.token_ids", limits.vocab_size)
    mask = _loss_mask(d.get("loss_mask"), f"{what}.loss_mask", tokens.size)
    _check_lengths(tokens, mask, what, limits)
    logprobs = _get(d, "logprobs", np.ndarray, what)
    if logprobs.ndim != 1 or logprobs.dtype.kind != "f" or logprobs.size != tokens.size:
        raise ProtocolError(f"{what}.logprobs: expected {tokens.size} floats (one per token), got {_describe(logprobs)} of {logprobs.size}")
    if mask is not None:  # an inserted token has no behaviour log-prob: whatever it carries is dropped
        logprobs = np.where(mask.astype(bool), logprobs, 0.0).astype(logprobs.dtype)
    if not np.isfinite(logprobs).all():
        raise ProtocolError(f"{what}.logprobs: not finite")
    parts = _get(d, "reward_parts", dict, what, {})
    for name, value in parts.items():
        if not isinstance(name, str) or isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ProtocolError(f"{what}.reward_parts: expected name -> number, got {name!r}: {type(value).__name__}")
        _finite(value, f"{what}.reward_parts[{name!r}]")
    try:
        runs = d.get("version_runs")
        versions = None if runs is None else decode_runs(runs, tokens.size, None if mask is None else mask.astype(bool), window)
    except VersionRunsError as err:
        raise ProtocolError(f"{what}.version_runs: {err}") from None
    return Sample(
        versions=versions,
        token_ids=tokens,
        logprobs=logprobs.astype(np.float32, copy=False),
        reward=_finite(_get(d, "reward", (int, float), what), f"{what}.reward"),
        finish_reason=_get(d, "finish_reason", str, what, ""),
        reward_parts={k: float(v) for k, v in parts.items()},
        correct=_finite(_get(d, "correct", (int, float), what, 0.0), f"{what}.correct"),
        loss_mask=mask,
    )


def _env_stats(value: Any, what: str) -> dict[str, float] | None:
    if value is None:
        return None
    if not isinstance(value, dict) or len(value) > _MAX_ENV_STATS:
        raise ProtocolError(f"{what}: expected a map of at most {_MAX_ENV_STATS} named numbers, got {_describe(value)}")
    for name, number in value.items():
        if not isinstance(name, str) or isinstance(number, bool) or not isinstance(number, (int, float)):
            raise ProtocolError(f"{what}: expected name -> number, got {name!r}: {type(number).__name__}")
        if not math.isfinite(number) or number < 0:
            raise ProtocolError(f"{what}[{name!r}]: {number} is not a finite count")
    return {k: float(v) for k, v in value.items()}


def _failures(value: Any, what: str) -> dict[str, list] | None:
    """Group.failures: name -> [calls, failed, text] with 0 <= failed <= calls."""
    if value is None:
        return None
    if not isinstance(value, dict) or len(value) > _MAX_ENV_STATS:
        raise ProtocolError(f"{what}: expected a map of at most {_MAX_ENV_STATS} names, got {_describe(value)}")
    out = {}
    for name, tally in value.items():
        ok = isinstance(name, str) and isinstance(tally, (list, tuple)) and len(tally) == 3
        calls, failed, text = tally if ok else (None, None, None)
        counts = all(isinstance(n, int) and not isinstance(n, bool) for n in (calls, failed))
        if not (ok and counts and isinstance(text, str) and 0 <= failed <= calls and len(text) <= _MAX_ERROR_CHARS):
            raise ProtocolError(f"{what}[{name!r}]: expected [calls, failed <= calls, error text], got {_describe(tally)}")
        out[name] = [calls, failed, text]
    return out


def group_from(data: Any, limits: GroupLimits = GroupLimits()) -> Group:
    d = _mapping(data, "group")
    where = "group"
    iteration = _get(d, "iteration", int, where)
    prompt_id = _get(d, "prompt_id", int, where)
    where = f"group {iteration}/{prompt_id}"
    version = _get(d, "policy_version", int, where)
    if iteration < 0 or version < 0:
        raise ProtocolError(f"{where}: negative iteration or policy_version ({iteration}, {version})")
    if limits.newest_version is not None and version > limits.newest_version:
        raise ProtocolError(f"{where}: policy_version {version} is from the future (newest published: {limits.newest_version})")
    if version > iteration:
        raise ProtocolError(f"{where}: policy_version {version} is newer than its iteration {iteration}")
    raw_samples = _get(d, "samples", list, where)
    window = (version, iteration if limits.newest_version is None else min(iteration, limits.newest_version))  # a token's versions
    if limits.group_size is not None and len(raw_samples) != limits.group_size:
        raise ProtocolError(f"{where}: {len(raw_samples)} samples, expected group_size {limits.group_size}")
    if not raw_samples:
        raise ProtocolError(f"{where}: no samples")
    group = Group(
        iteration=iteration,
        prompt_id=prompt_id,
        policy_version=version,
        worker_id=_get(d, "worker_id", str, where),
        prompt_ids=_token_array(_get(d, "prompt_ids", np.ndarray, where), f"{where}.prompt_ids", limits.vocab_size),
        samples=[_sample_from(s, f"{where}.samples[{i}]", limits, window) for i, s in enumerate(raw_samples)],
        gen_start=_finite(_get(d, "gen_start", (int, float), where, 0.0), f"{where}.gen_start"),
        gen_end=_finite(_get(d, "gen_end", (int, float), where, 0.0), f"{where}.gen_end"),
        reward_errors=_get(d, "reward_errors", int, where, 0),
        weight_load_seconds=_finite(_get(d, "weight_load_seconds", (int, float), where, 0.0), f"{where}.weight_load_seconds"),
        worker_idle_seconds=_finite(_get(d, "worker_idle_seconds", (int, float), where, 0.0), f"{where}.worker_idle_seconds"),
    )
    if not group.prompt_ids.size:
        raise ProtocolError(f"{where}.prompt_ids: empty prompt")
    group.env_stats = _env_stats(d.get("env_stats"), f"{where}.env_stats")
    group.reward_stats = _env_stats(d.get("reward_stats"), f"{where}.reward_stats")
    group.failures = _failures(d.get("failures"), f"{where}.failures")
    group.images = image_inputs_from(d.get("images"), f"{where}.images", ProtocolError)
    return group


def decode_group(data: bytes, limits: GroupLimits = GroupLimits()) -> Group:
    return group_from(unpack(data, limits.max_bytes), limits)


def group_key(data: bytes, max_bytes: int | None = None) -> tuple[int, int] | None:
    """(iteration, prompt id) of a group message that failed validation, if it still says which
    prompt it answers: that prompt's work goes out again. None when not even that is readable."""
    try:
        d = unpack(data, max_bytes)
    except ProtocolError:
        return None
    if not isinstance(d, dict):
        return None
    key = d.get("iteration"), d.get("prompt_id")
    return key if all(isinstance(k, int) and not isinstance(k, bool) for k in key) else None


def policy_pointer_from(data: Any) -> PolicyPointer:
    d = _mapping(data, "policy pointer")
    return PolicyPointer(version=_get(d, "version", int, "policy pointer"), uri=_get(d, "uri", str, "policy pointer"))


def run_status_from(data: Any) -> RunStatus:
    d = _mapping(data, "run status")
    raw = _get(d, "state", str, "run status")
    try:
        state = RunState(raw)
    except ValueError:
        raise ProtocolError(f"run status: unknown state {raw!r} (one of {[s.value for s in RunState]})") from None
    round_index = d.get("round")
    if round_index is not None and (isinstance(round_index, bool) or not isinstance(round_index, int)):
        raise ProtocolError(f"run status.round: expected int, got {type(round_index).__name__}")
    return RunStatus(state=state, round=round_index)
