"""Shared-prompt ("packed group") layout for GRPO log-probs.

A GRPO group is one prompt with G sampled responses. Instead of G rows
``prompt + r_i`` (the naive layout, which runs the prompt G times), each group
becomes one segment ``[prompt, r_1, ..., r_G]`` of a single packed row:

* a prompt token sees the earlier prompt tokens of its own group;
* a response token sees its group's whole prompt and the earlier tokens of its
  own response (and itself), nothing of the other responses or groups;
* position ids restart at ``len(prompt)`` for every response, so response i
  token j sits at position ``P + j`` exactly as in the naive layout.

The first token of every response is predicted by the logits of the prompt's
last position, which is therefore shared by all G responses of the group.

Works with stock Hugging Face causal LMs without touching their modeling code;
``logits_to_keep`` limits the vocabulary projection to the positions that
predict response tokens. Attention kernels (``kernel=``):

* ``"flex"``: FlexAttention ``BlockMask`` passed as ``attention_mask``; skips
  masked blocks. Default on CUDA (torch has no FlexAttention backward on CPU).
* ``"segmented"``: a registered HF attention function running SDPA once per
  prompt (causal) and once per group over ``[prompt, own response]`` keys,
  G*R*(P+R) scores instead of (P+G*R)^2. Default elsewhere.
* ``"sdpa"``: plain SDPA with a dense boolean ``[1, 1, T, T]`` mask passed as
  ``attention_mask``; simplest, quadratic in the packed length.

A multi-turn trajectory is one response: the tokens the environment and the chat
template inserted between turns sit in it like the sampled ones (each later token
sees them), and a per-token loss mask (optional third element of a group, one
0/1 sequence per response) says which tokens the policy sampled. Every output
carries it as ``loss_mask``; the losses read only those tokens.

Sliding-window layers are not supported (the custom mask replaces the window).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, fields, replace

import torch

from tidal.algo.logprobs import token_logprobs_from_logits
from tidal.buckets import length_buckets

Group = tuple[Sequence[int], Sequence[Sequence[int]]] | tuple[Sequence[int], Sequence[Sequence[int]], Sequence[Sequence[int] | None]]
"""``(prompt_ids, [response_ids, ...])``, or with ``[loss_mask, ...]`` (None: every token sampled)."""

KERNELS = ("auto", "sdpa", "flex", "segmented")
_SEGMENTED_ATTENTION = "tidal_segmented_sdpa"
_HF_ATTENTION = {"sdpa": "sdpa", "flex": "flex_attention", "segmented": _SEGMENTED_ATTENTION}
_PAD_ID = 0  # any valid id; padded positions never influence real ones


@dataclass(frozen=True)
class PackedBatch:
    """Several groups packed into one row; ``T`` tokens, ``N`` response tokens."""

    input_ids: torch.Tensor  # [1, T]
    position_ids: torch.Tensor  # [1, T]
    group_ids: torch.Tensor  # [T] index of the group each token belongs to
    response_ids: torch.Tensor  # [T] global response index, -1 for prompt tokens
    logit_index: torch.Tensor  # [N] position whose logits predict response token n
    target_ids: torch.Tensor  # [N] the response tokens, in packed order
    response_row: torch.Tensor  # [N] global response index of token n
    response_col: torch.Tensor  # [N] index of token n inside its response
    prompt_lengths: tuple[int, ...]  # P of each group
    group_sizes: tuple[int, ...]  # G of each group
    response_lengths: tuple[int, ...]  # length of each response, global order
    loss_mask: torch.Tensor  # [N] bool: token n was sampled by the policy (trained on)

    @property
    def num_tokens(self) -> int:
        return self.input_ids.shape[1]

    def to(self, device: torch.device | str) -> PackedBatch:
        tensors = {f.name: getattr(self, f.name) for f in fields(self)}
        return replace(self, **{k: v.to(device) for k, v in tensors.items() if isinstance(v, torch.Tensor)})


@dataclass(frozen=True)
class GroupTokenLogprobs:
    """Per-token values of one group, right-padded to its longest response."""

    logprobs: torch.Tensor  # [G, R_max] float32, 0 where ``mask`` is False
    mask: torch.Tensor  # [G, R_max] bool, True on response tokens
    entropy: torch.Tensor | None = None  # [G, R_max] float32 when requested
    loss_mask: torch.Tensor | None = None  # [G, R_max] bool, True on sampled response tokens; None: ``mask``

    @property
    def trained(self) -> torch.Tensor:
        """The tokens the losses read: the sampled ones."""
        return self.mask if self.loss_mask is None else self.loss_mask


def group_parts(group: Group) -> tuple[Sequence[int], Sequence[Sequence[int]], list[Sequence[int] | None]]:
    """``(prompt, responses, loss masks)`` of a group with or without masks; a mask must match its response."""
    prompt, responses, *rest = group
    masks = list(rest[0]) if rest else [None] * len(responses)
    if len(masks) != len(responses):
        raise ValueError(f"{len(masks)} loss masks for {len(responses)} responses")
    for i, (response, mask) in enumerate(zip(responses, masks)):
        if mask is not None and len(mask) != len(response):
            raise ValueError(f"response {i}: loss mask of {len(mask)} entries for {len(response)} tokens")
    return prompt, responses, masks


def group_num_tokens(group: Group) -> int:
    prompt, responses = group[0], group[1]
    return len(prompt) + sum(len(r) for r in responses)


def pack_groups(groups: Sequence[Group], device: torch.device | str | None = None) -> PackedBatch:
    """Pack ``groups`` into one row ``[p_1, r_11, .., r_1G, p_2, r_21, ..]``."""
    input_ids: list[int] = []
    position_ids: list[int] = []
    group_ids: list[int] = []
    response_ids: list[int] = []
    logit_index: list[int] = []
    target_ids: list[int] = []
    response_row: list[int] = []
    response_col: list[int] = []
    response_lengths: list[int] = []
    loss_mask: list[bool] = []

    for g, group in enumerate(groups):
        prompt, responses, masks = group_parts(group)
        if not prompt:
            raise ValueError(f"group {g} has an empty prompt; the first response token needs a predictor")
        prompt_len = len(prompt)
        prompt_last = len(input_ids) + prompt_len - 1
        input_ids += prompt
        position_ids += range(prompt_len)
        group_ids += [g] * prompt_len
        response_ids += [-1] * prompt_len
        for response, mask in zip(responses, masks):
            row, start, length = len(response_lengths), len(input_ids), len(response)
            input_ids += response
            position_ids += range(prompt_len, prompt_len + length)
            group_ids += [g] * length
            response_ids += [row] * length
            # token 0 is predicted by the prompt's last position, token j by token j-1
            logit_index += [prompt_last, *range(start, start + length - 1)][:length]
            target_ids += response
            response_row += [row] * length
            response_col += range(length)
            response_lengths.append(length)
            loss_mask += [True] * length if mask is None else [bool(m) for m in mask]

    def tensor(values: list[int]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.long, device=device)

    return PackedBatch(
        input_ids=tensor(input_ids).unsqueeze(0),
        position_ids=tensor(position_ids).unsqueeze(0),
        group_ids=tensor(group_ids),
        response_ids=tensor(response_ids),
        logit_index=tensor(logit_index),
        target_ids=tensor(target_ids),
        response_row=tensor(response_row),
        response_col=tensor(response_col),
        prompt_lengths=tuple(len(group[0]) for group in groups),
        group_sizes=tuple(len(group[1]) for group in groups),
        response_lengths=tuple(response_lengths),
        loss_mask=torch.tensor(loss_mask, dtype=torch.bool, device=device),
    )


def split_into_microbatches(groups: Sequence[Group], token_budget: int) -> list[list[Group]]:
    """Greedily pack consecutive groups into micro-batches of at most ``token_budget`` packed tokens.

    Order is preserved (concatenating the result gives back ``groups``). A group
    larger than the budget on its own becomes a micro-batch by itself.
    """
    if token_budget <= 0:
        raise ValueError(f"token_budget must be positive, got {token_budget}")
    microbatches: list[list[Group]] = []
    current: list[Group] = []
    current_tokens = 0
    for group in groups:
        tokens = group_num_tokens(group)
        if current and current_tokens + tokens > token_budget:
            microbatches.append(current)
            current, current_tokens = [], 0
        current.append(group)
        current_tokens += tokens
    if current:
        microbatches.append(current)
    return microbatches


def _visible(group_ids, response_ids, q_idx, kv_idx):
    """Whether query ``q_idx`` may attend to key ``kv_idx`` (shared by both kernels)."""
    kv_response = response_ids[kv_idx]
    same_group = group_ids[q_idx] == group_ids[kv_idx]
    prompt_or_own = (kv_response == -1) | (kv_response == response_ids[q_idx])
    return same_group & prompt_or_own & (kv_idx <= q_idx)


def dense_attention_mask(packed: PackedBatch) -> torch.Tensor:
    """Boolean ``[1, 1, T, T]`` mask for SDPA, True where attention is allowed."""
    positions = torch.arange(packed.num_tokens, device=packed.input_ids.device)
    mask = _visible(packed.group_ids, packed.response_ids, positions[:, None], positions[None, :])
    return mask[None, None]


def flex_block_mask(packed: PackedBatch):
    """FlexAttention ``BlockMask`` of the same pattern, skipping fully masked blocks."""
    from torch.nn.attention.flex_attention import create_block_mask

    group_ids, response_ids = packed.group_ids, packed.response_ids

    def mask_mod(batch, head, q_idx, kv_idx):
        return _visible(group_ids, response_ids, q_idx, kv_idx)

    tokens = packed.num_tokens
    return create_block_mask(mask_mod, None, None, tokens, tokens, device=packed.input_ids.device)


@dataclass(frozen=True)
class ResponseBucket:
    """Responses of similar length, attended in one SDPA call (R = the longest of them; padding indexes any
    valid position and is masked)."""

    index: torch.Tensor  # [responses, R] packed position of each response token
    keys: torch.Tensor  # [responses, P + R] keys of each response: its group's prompt, then its own tokens
    mask: torch.Tensor  # [responses, 1, R, P + R] the prompt, then causal over its own tokens
    valid: torch.Tensor  # [responses, R] True on real response tokens


@dataclass(frozen=True)
class SegmentedLayout:
    """Index tensors of the ``"segmented"`` kernel for one packed row, every group batched together
    (P = longest prompt; padding indexes any valid position and is masked). One SDPA call for the prompts
    and one per bucket of responses of similar length (`length_buckets`), whatever the number of groups:
    per-group calls cost more in dispatch than in arithmetic for the short sequences of RL post-training,
    and one call padding every response to the longest costs (longest / typical)^2 in attention where
    multi-turn trajectories vary tenfold in length."""

    prompt_index: torch.Tensor  # [groups, P] packed position of each prompt token
    prompt_mask: torch.Tensor  # [groups, 1, P, P] causal, padding keys hidden
    prompt_valid: torch.Tensor  # [groups, P] True on real prompt tokens
    buckets: tuple[ResponseBucket, ...]
    packed_order: torch.Tensor  # [T] where each packed position sits in the concatenated (prompts, buckets) outputs


def segmented_layout(packed: PackedBatch) -> SegmentedLayout:
    """Index tensors the ``"segmented"`` kernel needs; built once per forward, shared by all layers."""
    device = packed.input_ids.device
    prompt_width = max(packed.prompt_lengths)
    prompt_rows, prompt_valid, own_rows, prompt_of_response = [], [], [], []
    row, start = 0, 0
    for prompt_len, size in zip(packed.prompt_lengths, packed.group_sizes, strict=True):
        prompt_rows.append(list(range(start, start + prompt_len)) + [start] * (prompt_width - prompt_len))
        prompt_valid.append([True] * prompt_len + [False] * (prompt_width - prompt_len))
        at = start + prompt_len
        for length in packed.response_lengths[row : row + size]:
            own_rows.append(list(range(at, at + length)))
            prompt_of_response.append(len(prompt_rows) - 1)
            at += length
        row += size
        start = at

    def tensor(values, dtype=torch.long):
        return torch.tensor(values, dtype=dtype, device=device)

    prompt_index, prompt_ok = tensor(prompt_rows), tensor(prompt_valid, torch.bool)
    causal_p = torch.ones(prompt_width, prompt_width, dtype=torch.bool, device=device).tril()
    prompt_mask = (causal_p[None] & prompt_ok[:, None, :])[:, None]
    buckets = []
    for members in length_buckets(packed.response_lengths):
        width = max(packed.response_lengths[i] for i in members)
        own = [own_rows[i] + [own_rows[i][0] if own_rows[i] else 0] * (width - len(own_rows[i])) for i in members]
        valid = tensor([[True] * len(own_rows[i]) + [False] * (width - len(own_rows[i])) for i in members], torch.bool).reshape(len(members), width)
        keys = tensor([prompt_rows[prompt_of_response[i]] + row for i, row in zip(members, own)]).reshape(len(members), prompt_width + width)
        causal_r = torch.ones(width, width, dtype=torch.bool, device=device).tril()
        prompt_keys = prompt_ok[tensor([prompt_of_response[i] for i in members])][:, None, :].expand(-1, width, -1)  # [responses, R, P]
        mask = torch.cat([prompt_keys, causal_r[None] & valid[:, None, :]], dim=2)[:, None]
        buckets.append(ResponseBucket(tensor(own).reshape(len(members), width), keys, mask, valid))
    output_index = torch.cat([prompt_index[prompt_ok], *(b.index[b.valid] for b in buckets)])
    packed_order = torch.empty_like(output_index)
    packed_order[output_index] = torch.arange(len(output_index), device=device)
    return SegmentedLayout(prompt_index, prompt_mask, prompt_ok, tuple(buckets), packed_order)


def _segmented_sdpa(module, query, key, value, attention_mask=None, scaling=None, segmented_layout=None, **kwargs):
    """HF attention function: every prompt's causal self-attention in one call, then each bucket's responses'
    attention over [their prompt, themselves] in one call per bucket. Costs about responses * R * (P + R)
    scores instead of the (P + G * R)^2 per group of a dense mask."""
    layout = segmented_layout
    query, key, value = query[0], key[0], value[0]  # [H, T, D]; key and value [H_kv, T, D]
    # grouped-query attention inside SDPA: the key/value heads are gathered once, not once per query head
    gqa = {"enable_gqa": True} if key.shape[0] != query.shape[0] else {}

    def sdpa(q, k, v, **kwargs):
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, **kwargs, **gqa)

    def rows(x, index):  # [H, T, D] -> [rows, H, width, D]
        return x[:, index].transpose(0, 1)

    prompts = sdpa(
        rows(query, layout.prompt_index),
        rows(key, layout.prompt_index),
        rows(value, layout.prompt_index),
        attn_mask=layout.prompt_mask,
        scale=scaling,
    )
    outputs = [prompts.transpose(0, 1)[:, layout.prompt_valid]]
    for bucket in layout.buckets:
        q = rows(query, bucket.index)
        k, v = rows(key, bucket.keys), rows(value, bucket.keys)
        responses = sdpa(q, k, v, attn_mask=bucket.mask, scale=scaling)  # [responses, H, R, D]
        outputs.append(responses.transpose(0, 1)[:, bucket.valid])
    attn_output = torch.cat(outputs, dim=1)[:, layout.packed_order]  # [H, T, D]
    return attn_output.transpose(0, 1)[None], None


def _register_segmented_attention() -> None:
    from transformers import AttentionInterface

    AttentionInterface.register(_SEGMENTED_ATTENTION, _segmented_sdpa)


def flex_attention_supported(device: torch.device | str, requires_grad: bool = True) -> bool:
    """FlexAttention trains on CUDA only; on CPU torch implements its forward pass but not its backward."""
    try:
        import torch.nn.attention.flex_attention  # noqa: F401
    except ImportError:
        return False
    device_type = torch.device(device).type
    return device_type == "cuda" or (device_type == "cpu" and not requires_grad)


def resolve_kernel(kernel: str, device: torch.device | str) -> str:
    """Map ``"auto"`` to ``"flex"`` on CUDA and ``"segmented"`` elsewhere; validate explicit choices."""
    if kernel not in KERNELS:
        raise ValueError(f"unknown attention kernel {kernel!r}; expected one of {KERNELS}")
    if kernel == "auto":
        return "flex" if torch.device(device).type == "cuda" and flex_attention_supported(device) else "segmented"
    if kernel == "flex" and not flex_attention_supported(device, requires_grad=torch.is_grad_enabled()):
        raise ValueError(
            f"FlexAttention unsupported on this device ({torch.device(device).type}, "
            f"grad enabled={torch.is_grad_enabled()}); use kernel='segmented' or 'sdpa'"
        )
    return kernel


@contextmanager
def _attention_implementation(model: torch.nn.Module, name: str) -> Iterator[None]:
    # HF attention modules read config._attn_implementation on every forward.
    config = model.config
    previous = config._attn_implementation
    config._attn_implementation = name
    try:
        yield
    finally:
        config._attn_implementation = previous


def enable_activation_checkpointing(model: torch.nn.Module) -> None:
    """HF gradient checkpointing (non-reentrant) whose recomputation in backward runs with the
    attention implementation the forward pass used: the packed layout switches it only for the
    duration of its forward (`_attention_implementation`), and a recomputation under another
    implementation would differ (torch's CheckpointError)."""

    def context_fn():
        name = model.config._attn_implementation  # captured at forward time
        return contextlib.nullcontext(), _attention_implementation(model, name)

    kwargs = {"use_reentrant": False, "context_fn": context_fn}
    if hasattr(model, "activation_checkpointing_enable"):  # transformers >= 5.24 (the older name is deprecated there)
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)


def scatter_rows(values: torch.Tensor, packed: PackedBatch) -> torch.Tensor:
    """Packed per-token ``values [N]`` -> ``[responses, R_max]``, right-padded with zeros."""
    width = max(packed.response_lengths, default=0)
    return values.new_zeros(len(packed.response_lengths), width).index_put((packed.response_row, packed.response_col), values)


def response_mask(packed: PackedBatch) -> torch.Tensor:
    """``[responses, R_max]`` bool, True on real response tokens."""
    lengths = torch.tensor(packed.response_lengths, dtype=torch.long, device=packed.input_ids.device)
    width = max(packed.response_lengths, default=0)
    return torch.arange(width, device=lengths.device)[None, :] < lengths[:, None]


def group_cuts(group_sizes: Sequence[int], response_lengths: Sequence[int]) -> list[tuple[slice, slice]]:
    """Each group's (rows, columns) in a block of response rows: its rows, up to its own longest response."""
    cuts, start = [], 0
    for size in group_sizes:
        cuts.append((slice(start, start + size), slice(0, max(response_lengths[start : start + size], default=0))))
        start += size
    return cuts


def _attention_inputs(packed: PackedBatch, kernel: str) -> dict:
    if kernel == "flex":
        return {"attention_mask": flex_block_mask(packed)}
    if kernel == "segmented":
        # A custom attention name makes HF skip mask creation; the layout reaches the attention function as a kwarg.
        _register_segmented_attention()
        return {"segmented_layout": segmented_layout(packed)}
    return {"attention_mask": dense_attention_mask(packed)}


def packed_token_logprobs(
    model: torch.nn.Module,
    packed: PackedBatch,
    temperature: float = 1.0,
    kernel: str = "auto",
    with_entropy: bool = False,
) -> list[GroupTokenLogprobs]:
    """Per-token log-probs of every response in ``packed``, one forward pass, one entry per group."""
    return split_per_group(packed_row_logprobs(model, packed, temperature, kernel, with_entropy), packed.group_sizes, packed.response_lengths)


def packed_row_logprobs(
    model: torch.nn.Module,
    packed: PackedBatch,
    temperature: float = 1.0,
    kernel: str = "auto",
    with_entropy: bool = False,
) -> GroupTokenLogprobs:
    """`packed_token_logprobs` as one ``[N responses, R_max]`` block, every group's rows in order."""
    device = packed.input_ids.device
    kernel = resolve_kernel(kernel, device)
    with _attention_implementation(model, _HF_ATTENTION[kernel]):
        logits = model(
            input_ids=packed.input_ids,
            position_ids=packed.position_ids,
            logits_to_keep=packed.logit_index,
            use_cache=False,
            **_attention_inputs(packed, kernel),
        ).logits[0]
    return packed_rows(packed, *token_logprobs_from_logits(logits, packed.target_ids, temperature, with_entropy))


def packed_rows(packed: PackedBatch, logprobs: torch.Tensor, entropy: torch.Tensor | None) -> GroupTokenLogprobs:
    """Packed per-token values ([N tokens]) as one right-padded block of response rows."""
    return GroupTokenLogprobs(
        logprobs=scatter_rows(logprobs, packed),
        mask=response_mask(packed),
        entropy=None if entropy is None else scatter_rows(entropy, packed),
        loss_mask=scatter_rows(packed.loss_mask, packed),
    )


def split_per_group(rows: GroupTokenLogprobs, group_sizes: Sequence[int], response_lengths: Sequence[int]) -> list[GroupTokenLogprobs]:
    """One block of response rows -> one entry per group, each cut to its own longest response."""
    return [
        GroupTokenLogprobs(
            logprobs=rows.logprobs[cut],
            mask=rows.mask[cut],
            entropy=None if rows.entropy is None else rows.entropy[cut],
            loss_mask=None if rows.loss_mask is None else rows.loss_mask[cut],
        )
        for cut in group_cuts(group_sizes, response_lengths)
    ]


def stack_groups(outs: Sequence[GroupTokenLogprobs]) -> GroupTokenLogprobs:
    """Per-group entries -> one block of response rows, right-padded to the longest response (zeros, mask False)."""

    def stack(parts: list[torch.Tensor]) -> torch.Tensor:
        width = max((p.shape[1] for p in parts), default=0)
        return torch.cat([torch.nn.functional.pad(p, (0, width - p.shape[1])) for p in parts])

    return GroupTokenLogprobs(
        logprobs=stack([o.logprobs for o in outs]),
        mask=stack([o.mask for o in outs]),
        entropy=None if outs[0].entropy is None else stack([o.entropy for o in outs]),
        loss_mask=stack([o.trained for o in outs]),
    )


def naive_token_logprobs(
    model: torch.nn.Module,
    groups: Sequence[Group],
    temperature: float = 1.0,
    with_entropy: bool = False,
) -> list[GroupTokenLogprobs]:
    """Reference: each group as G right-padded rows ``prompt + r_i`` with the model's own attention.

    No padding mask is passed: padding sits after every real token, and causal
    attention keeps real tokens from seeing it.
    """
    device = next(model.parameters()).device
    results = []
    for group in groups:
        prompt, responses, masks = group_parts(group)
        prompt_len, width = len(prompt), max((len(r) for r in responses), default=0)
        targets = torch.full((len(responses), width), _PAD_ID, dtype=torch.long, device=device)
        mask = torch.zeros(len(responses), width, dtype=torch.bool, device=device)
        loss_mask = torch.zeros(len(responses), width, dtype=torch.bool, device=device)
        for i, (response, sampled) in enumerate(zip(responses, masks)):
            targets[i, : len(response)] = torch.tensor(response, dtype=torch.long, device=device)
            mask[i, : len(response)] = True
            loss_mask[i, : len(response)] = True if sampled is None else torch.tensor([bool(m) for m in sampled], dtype=torch.bool)
        if width == 0:
            zeros = torch.zeros(len(responses), 0, device=device)
            results.append(GroupTokenLogprobs(zeros, mask, zeros if with_entropy else None, loss_mask))
            continue
        prompts = torch.tensor(prompt, dtype=torch.long, device=device).expand(len(responses), -1)
        logits = model(
            input_ids=torch.cat([prompts, targets], dim=1),
            logits_to_keep=torch.arange(prompt_len - 1, prompt_len + width - 1, device=device),
            use_cache=False,
        ).logits
        logprobs, entropy = token_logprobs_from_logits(logits, targets, temperature, with_entropy)
        results.append(
            GroupTokenLogprobs(
                logprobs=logprobs.masked_fill(~mask, 0.0),
                mask=mask,
                entropy=entropy.masked_fill(~mask, 0.0) if with_entropy else None,
                loss_mask=loss_mask,
            )
        )
    return results
