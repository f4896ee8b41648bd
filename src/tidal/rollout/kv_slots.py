"""The HF engine's KV cache layers with spare slots after their tokens.

transformers' DynamicLayer appends each decode step's keys and values with `torch.cat`, copying the
whole cache of every row at every step: on CPU that copy cost more than the attention itself. A
`SpareSlotsLayer` keeps its keys and values as the first slots of larger buffers and writes a step's
into the next free slots in place; it copies the whole cache only when the buffers are full (every
`SPARE` steps). When rows leave the decode batch, rows from after them move into their places
(`fill_holes`) and joining rows take the rows left free (`stack_rows`): only the rows that move are
copied, and a new buffer is built only when the joining rows do not fit. Keys and values stay what
DynamicLayer would hold, so a forward pass over them is the same computation.
"""

from __future__ import annotations

import torch
from transformers.cache_utils import DynamicLayer

SPARE = 64  # slots kept free after the tokens: one copy of the cache every SPARE decode steps


class SpareSlotsLayer(DynamicLayer):
    """A DynamicLayer whose `keys`/`values` are views of `buffers`: the first `keys.shape[0]` rows, the
    slots from `start` on."""

    buffers: tuple[torch.Tensor, torch.Tensor] | None = None
    view: torch.Tensor | None = None  # the `keys` this layer last set: anything else was set from outside
    start: int = 0  # the buffers' slot where the keys begin (slots before it: no row's token any more)

    def _owns_keys(self) -> bool:
        return self.buffers is not None and self.keys is self.view

    def _set(self, keys_buffer: torch.Tensor, values_buffer: torch.Tensor, length: int, start: int = 0, rows: int | None = None) -> None:
        self.buffers, self.start = (keys_buffer, values_buffer), start
        rows = keys_buffer.shape[0] if rows is None else rows
        self.keys, self.values = keys_buffer[:rows, :, start : start + length], values_buffer[:rows, :, start : start + length]
        self.view = self.keys

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.is_initialized or self.keys.numel() == 0:
            return super().update(key_states, value_states, *args, **kwargs)
        length, new = self.keys.shape[-2], key_states.shape[-2]
        if not self._owns_keys() or self.buffers[0].shape[-2] < self.start + length + new:
            self._set(with_spare(self.keys, new + SPARE), with_spare(self.values, new + SPARE), length)
        keys_buffer, values_buffer = self.buffers
        rows, end = self.keys.shape[0], self.start + length
        keys_buffer[:rows, :, end : end + new] = key_states
        values_buffer[:rows, :, end : end + new] = value_states
        self._set(keys_buffer, values_buffer, length + new, self.start, rows)
        return self.keys, self.values


def with_spare(t: torch.Tensor, spare: int) -> torch.Tensor:
    """A buffer of `t`'s slots and `spare` more (dim 2), `t` copied in."""
    buffer = t.new_empty(t.shape[0], t.shape[1], t.shape[2] + spare, t.shape[3])
    buffer[:, :, : t.shape[2]] = t
    return buffer


def with_spare_slots(cache):
    """`cache` (as a model returns it) with its full-attention layers keeping spare slots; other
    layers (sliding windows) stay as they are."""
    for layer in cache.layers:
        if type(layer) is DynamicLayer:
            layer.__class__ = SpareSlotsLayer
    return cache


def keep_rows(layer, index: torch.Tensor, first: int) -> None:
    """The layer's cache of rows `index` only, from slot `first` on."""
    if isinstance(layer, SpareSlotsLayer):
        length = layer.keys.shape[-2] - first
        layer._set(*(rows_with_spare(t[:, :, first:], index) for t in (layer.keys, layer.values)), length)
    else:
        layer.keys, layer.values = layer.keys[index][:, :, first:], layer.values[index][:, :, first:]


def fill_holes(layer, holes: torch.Tensor, fillers: torch.Tensor, count: int, first: int) -> None:
    """The layer's cache of its first `count` rows, row `holes[i]` replaced by row `fillers[i]` (a row past
    `count`), from slot `first` on. A layer with buffers moves only the filling rows, in place: rows that
    leave the decode batch cost a copy of themselves, not of every row that stays."""
    if isinstance(layer, SpareSlotsLayer) and layer._owns_keys():
        length = layer.keys.shape[-2]
        for buffer in layer.buffers:
            used = buffer[:, :, layer.start : layer.start + length]
            if len(holes):
                used.index_copy_(0, holes, used.index_select(0, fillers))
        layer._set(*layer.buffers, length - first, layer.start + first, count)
        return
    order = torch.arange(count, device=holes.device)
    order[holes] = fillers
    keep_rows(layer, order, first)


def rows_with_spare(t: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """A buffer of `t`'s rows `index` and `SPARE` free slots after them (one gather, no second copy)."""
    buffer = t.new_empty(len(index), t.shape[1], t.shape[2] + SPARE, t.shape[3])
    torch.index_select(t, 0, index, out=buffer[:, :, : t.shape[2]])
    return buffer


def stack_rows(layer, other, width: int) -> None:
    """`other`'s rows after `layer`'s, both left-padded (zeros, which the mask hides) to `width` slots. A layer
    whose buffers have the rows and the slots (rows that left the batch leave theirs) takes them in place:
    only `other`'s rows are copied."""
    if isinstance(layer, SpareSlotsLayer) and layer._owns_keys():
        rows, length, joining = layer.keys.shape[0], layer.keys.shape[-2], other.keys.shape[0]
        end = layer.start + length
        start = end - width
        if start >= 0 and rows + joining <= layer.buffers[0].shape[0]:
            for buffer, theirs in zip(layer.buffers, (other.keys, other.values), strict=True):
                buffer[:rows, :, start : layer.start] = 0  # padding: a NaN here would survive its zero attention weight
                buffer[rows : rows + joining, :, start : end - theirs.shape[-2]] = 0
                buffer[rows : rows + joining, :, end - theirs.shape[-2] : end] = theirs
            layer._set(*layer.buffers, width, start, rows + joining)
            return
    set_rows(layer, [layer.keys, other.keys], [layer.values, other.values], width)


def set_rows(layer, keys: list[torch.Tensor], values: list[torch.Tensor], width: int) -> None:
    """The layer's cache: the rows of `keys`/`values` ([rows, heads, slots, dim] each) one after another,
    left-padded to `width` slots, with spare slots after them when the layer keeps some."""
    if isinstance(layer, SpareSlotsLayer):
        layer._set(padded_rows(keys, width, SPARE), padded_rows(values, width, SPARE), width)
    else:
        layer.keys, layer.values = padded_rows(keys, width, 0), padded_rows(values, width, 0)


def padded_rows(parts: list[torch.Tensor], width: int, spare: int) -> torch.Tensor:
    """`parts` ([rows, heads, slots, dim]) one after another, each right-aligned in `width` slots, with
    `spare` free slots after (never read before a step writes them)."""
    first = parts[0]
    rows = sum(p.shape[0] for p in parts)
    out = first.new_empty(rows, first.shape[1], width + spare, first.shape[3])
    start = 0
    for p in parts:
        end, slots = start + p.shape[0], p.shape[2]
        out[start:end, :, : width - slots] = 0  # padding: a NaN here would survive its zero attention weight
        out[start:end, :, width - slots : width] = p
        start = end
    return out
