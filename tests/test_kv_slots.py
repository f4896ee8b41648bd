"""The HF engine's cache layers with spare slots (tidal.rollout.kv_slots): the same keys and values as
transformers' DynamicLayer, written in place between reallocations, and rows kept or stacked as the
decode batch changes."""

import torch
from transformers.cache_utils import DynamicCache, DynamicLayer

from tidal.rollout.kv_slots import SPARE, SpareSlotsLayer, fill_holes, keep_rows, stack_rows, with_spare_slots


def _states(rows: int, slots: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(rows, 2, slots, 8, generator=g), torch.randn(rows, 2, slots, 8, generator=g)


def _pair() -> tuple[DynamicLayer, SpareSlotsLayer]:
    plain, spare = DynamicLayer(), DynamicLayer()
    spare.__class__ = SpareSlotsLayer
    prompt = _states(3, 5, 0)
    plain.update(*prompt)
    spare.update(*prompt)
    return plain, spare


def test_decode_steps_hold_what_a_dynamic_layer_holds_and_write_in_place_between_reallocations():
    plain, spare = _pair()
    pointers = []
    for step in range(SPARE + 3):
        new = _states(3, 1, 100 + step)
        expected = plain.update(*new)
        got = spare.update(*new)
        assert all(torch.equal(e, g) for e, g in zip(expected, got, strict=True))
        pointers.append(spare.keys.data_ptr())
    # the first step allocates buffers with SPARE slots to spare; the steps after write into them until they are
    # full, then the buffers grow once (DynamicLayer would have copied at every step)
    assert len(set(pointers[: SPARE + 1])) == 1
    assert len(set(pointers)) == 2
    assert spare.get_seq_length() == plain.get_seq_length() == 5 + SPARE + 3


def test_rows_kept_from_a_slot_on_hold_those_rows_and_decode_on_in_place():
    plain, spare = _pair()
    for step in range(4):
        new = _states(3, 1, 200 + step)
        plain.update(*new)
        spare.update(*new)
    index = torch.tensor([2, 0])
    keep_rows(plain, index, 2)
    keep_rows(spare, index, 2)
    assert torch.equal(plain.keys, spare.keys) and torch.equal(plain.values, spare.values)
    pointer = spare.keys.data_ptr()
    new = _states(2, 1, 300)
    assert all(torch.equal(e, g) for e, g in zip(plain.update(*new), spare.update(*new), strict=True))
    assert spare.keys.data_ptr() == pointer  # keep_rows left spare slots: the step did not copy


def _decoded(rows: int, seed: int) -> tuple[DynamicLayer, SpareSlotsLayer]:
    """A plain layer and a spare-slots one after a prompt of 5 slots and 3 decode steps, alike."""
    plain, spare = DynamicLayer(), DynamicLayer()
    spare.__class__ = SpareSlotsLayer
    for step, slots in enumerate([5, 1, 1, 1]):
        new = _states(rows, slots, seed + step)
        plain.update(*new)
        spare.update(*new)
    return plain, spare


def test_rows_that_leave_are_filled_in_place_by_rows_from_after_them():
    """Rows 1 and 3 of 6 leave: rows 4 and 5 take their places (only they move), the leading slots no row
    uses any more are cut, and the next step writes in place."""
    plain, spare = _decoded(6, 1000)
    keys_before, values_before = spare.keys.clone(), spare.values.clone()
    pointer = spare.buffers[0].data_ptr()
    holes, fillers = torch.tensor([1, 3]), torch.tensor([4, 5])
    fill_holes(spare, holes, fillers, 4, 2)
    order = torch.tensor([0, 4, 2, 5])
    assert torch.equal(spare.keys, keys_before[order][:, :, 2:]) and torch.equal(spare.values, values_before[order][:, :, 2:])
    assert spare.buffers[0].data_ptr() == pointer  # no new buffer
    fill_holes(plain, holes, fillers, 4, 2)  # a layer without buffers: the rows gathered
    assert torch.equal(plain.keys, spare.keys) and torch.equal(plain.values, spare.values)
    new = _states(4, 1, 1100)
    assert all(torch.equal(e, g) for e, g in zip(plain.update(*new), spare.update(*new), strict=True))
    assert spare.buffers[0].data_ptr() == pointer


def test_rows_join_in_place_where_rows_have_left_room_and_are_padded_with_zeros():
    """After rows left, joining rows take their buffer rows: the layer's rows keep their values, theirs are
    right-aligned after zeros, the layer's own rows get zeros before them when the joining rows are wider,
    and nothing is reallocated; where the buffers lack the rows, a new one is built alike."""
    _, spare = _decoded(6, 2000)
    fill_holes(spare, torch.tensor([0, 1]), torch.tensor([4, 5]), 4, 3)  # 4 rows of 5 slots, from buffer slot 3 on
    for buffer in spare.buffers:  # slots no row uses any more may hold anything: stacking must not read them
        buffer[:, :, : spare.start].fill_(float("nan"))
    before = spare.keys.clone()
    pointer = spare.buffers[0].data_ptr()
    joining = DynamicLayer()
    joining.update(*_states(2, 7, 2100))
    stack_rows(spare, joining, 7)
    assert spare.keys.shape == (6, 2, 7, 8) and spare.buffers[0].data_ptr() == pointer
    assert torch.equal(spare.keys[:4, :, 2:], before) and not spare.keys[:4, :, :2].any()
    assert torch.equal(spare.keys[4:], joining.keys) and torch.equal(spare.values[4:], joining.values)
    wider = DynamicLayer()
    wider.update(*_states(1, 3, 2200))
    stack_rows(spare, wider, 7)  # 7 rows: more than the buffers hold
    assert spare.keys.shape == (7, 2, 7, 8) and spare.buffers[0].data_ptr() != pointer
    assert torch.equal(spare.keys[6:, :, 4:], wider.keys) and not spare.keys[6:, :, :4].any()


def test_stacked_rows_are_left_padded_with_zeros_and_keep_spare_slots():
    _, spare = _pair()
    joining = DynamicLayer()
    joining.update(*_states(2, 3, 400))
    before_keys, before_values = spare.keys.clone(), spare.values.clone()
    stack_rows(spare, joining, 5)
    assert spare.keys.shape == (5, 2, 5, 8)
    assert torch.equal(spare.keys[:3], before_keys) and torch.equal(spare.values[:3], before_values)
    assert torch.equal(spare.keys[3:, :, 2:], joining.keys)
    assert not spare.keys[3:, :, :2].any() and not spare.values[3:, :, :2].any()  # padding: zeros, not garbage
    pointer = spare.keys.data_ptr()
    spare.update(*_states(5, 1, 500))
    assert spare.keys.data_ptr() == pointer


def test_keys_set_from_outside_are_copied_before_a_step_writes():
    _, spare = _pair()
    spare.update(*_states(3, 1, 600))
    outside = _states(3, 6, 700)
    spare.keys, spare.values = outside[0], outside[1]
    kept = outside[0].clone()
    keys, _ = spare.update(*_states(3, 1, 800))
    assert torch.equal(outside[0], kept)  # the caller's tensor is not written into
    assert torch.equal(keys[:, :, :6], kept)


def test_a_models_cache_takes_spare_slots_on_its_full_attention_layers_only():
    cache = DynamicCache()
    cache.update(*_states(1, 2, 900), layer_idx=0)
    with_spare_slots(cache)
    assert type(cache.layers[0]) is SpareSlotsLayer
