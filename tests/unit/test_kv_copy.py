"""BlockCopier on CPU tensors: loads and saves land the exact bytes in the exact blocks, for
vLLM-CPU's block-first layout and vLLM-GPU's transposed ``[2, num_blocks, ...]`` views, in
chunks bigger than staging, through both CPU code paths (per-block runs and index gathers)."""

from __future__ import annotations

import pytest
import torch

from kvstore import kv_copy
from kvstore.kv_copy import BlockCopier, CopyHandle, _runs

NUM_LAYERS = 3
NUM_BLOCKS = 12
NUM_SLOTS = 10


def _cpu_layout() -> list[torch.Tensor]:
    """vLLM-CPU: per layer ``[num_blocks, kv_heads, block_size, 2 * head_dim]``, block-first."""
    return [torch.zeros(NUM_BLOCKS, 2, 8, 6, dtype=torch.bfloat16) for _ in range(NUM_LAYERS)]


def _gpu_layout() -> list[torch.Tensor]:
    """vLLM-GPU: per layer ``[2, num_blocks, block_size, kv_heads, head_dim]``, viewed
    block-first (a transposed, non-contiguous view, as the connector binds it)."""
    return [torch.zeros(2, NUM_BLOCKS, 4, 2, 3, dtype=torch.float16).transpose(0, 1)
            for _ in range(NUM_LAYERS)]


LAYOUTS = {"cpu": _cpu_layout, "gpu-transposed": _gpu_layout}


def _arena(layers: list[torch.Tensor], seed: int = 0) -> torch.Tensor:
    """A host arena ``[slot, layer, *block_shape]`` of distinct values, from a uint8 buffer
    the way the connector views the shared-memory file."""
    shape = (NUM_SLOTS, len(layers), *layers[0].shape[1:])
    values = torch.randn(shape, generator=torch.Generator().manual_seed(seed)).to(layers[0].dtype)
    raw = torch.empty(values.numel() * values.element_size(), dtype=torch.uint8)
    arena = raw.view(values.dtype).view(shape)
    arena.copy_(values)
    return arena


@pytest.fixture(params=[True, False], ids=["per-block", "gather"])
def copy_mode(request, monkeypatch):
    """Both CPU code paths, whichever the block size would pick."""
    monkeypatch.setattr(kv_copy, "CPU_PER_BLOCK_MIN_BYTES", 0 if request.param else 1 << 40)
    return request.param


@pytest.mark.parametrize("layout", LAYOUTS)
def test_load_puts_each_slot_in_its_block_for_every_layer(layout, copy_mode):
    layers = LAYOUTS[layout]()
    arena = _arena(layers)
    copier = BlockCopier(layers, staging_blocks=2)
    slots, block_ids = [7, 2, 3, 4, 0], [1, 9, 10, 11, 5]  # a run (2,3,4 -> 9,10,11) and singles
    handle = copier.load(arena, slots, block_ids)
    handle.wait()
    assert handle.done()
    for index, layer in enumerate(layers):
        for slot, block in zip(slots, block_ids):
            assert torch.equal(layer[block], arena[slot, index])
        untouched = sorted(set(range(NUM_BLOCKS)) - set(block_ids))
        assert torch.count_nonzero(layer[untouched]) == 0


@pytest.mark.parametrize("layout", LAYOUTS)
def test_save_puts_each_block_in_its_slot_and_leaves_other_slots(layout, copy_mode):
    layers = LAYOUTS[layout]()
    for index, layer in enumerate(layers):
        layer.copy_(torch.randn(layer.shape, generator=torch.Generator().manual_seed(index + 1)))
    arena = _arena(layers)
    before = arena.clone()
    copier = BlockCopier(layers)
    block_ids, slots = [3, 4, 5, 0, 11], [6, 7, 8, 1, 9]
    copier.save(arena, block_ids, slots).wait()
    for index, layer in enumerate(layers):
        for block, slot in zip(block_ids, slots):
            assert torch.equal(arena[slot, index], layer[block])
    others = sorted(set(range(NUM_SLOTS)) - set(slots))
    assert torch.equal(arena[others], before[others])


@pytest.mark.parametrize("layout", LAYOUTS)
def test_round_trip_through_the_arena_restores_the_cache(layout, copy_mode):
    source = LAYOUTS[layout]()
    for layer in source:
        layer.copy_(torch.randn(layer.shape))
    arena = _arena(source, seed=3)
    block_ids = [11, 0, 6, 7, 8, 2, 3]  # more blocks than staging: three chunks
    slots = [0, 9, 1, 2, 3, 5, 4]
    BlockCopier(source, staging_blocks=3).save(arena, block_ids, slots).wait()
    target = LAYOUTS[layout]()
    BlockCopier(target, staging_blocks=3).load(arena, slots, block_ids).wait()
    for src, dst in zip(source, target):
        assert torch.equal(dst[block_ids], src[block_ids])
        others = sorted(set(range(NUM_BLOCKS)) - set(block_ids))
        assert torch.count_nonzero(dst[others]) == 0


def test_a_copy_larger_than_staging_moves_every_block():
    layers = _gpu_layout()
    arena = _arena(layers)
    copier = BlockCopier(layers, staging_blocks=1)
    slots = list(range(NUM_SLOTS))
    block_ids = [NUM_BLOCKS - 1 - s for s in slots]
    copier.load(arena, slots, block_ids).wait()
    for index, layer in enumerate(layers):
        assert torch.equal(layer[block_ids], arena[slots, index])


def test_the_same_slot_loaded_into_two_blocks():
    layers = _cpu_layout()
    arena = _arena(layers)
    BlockCopier(layers).load(arena, [4, 4], [0, 1]).wait()
    assert torch.equal(layers[1][0], arena[4, 1]) and torch.equal(layers[1][1], arena[4, 1])


def test_empty_copies_are_done_at_once_and_touch_nothing():
    layers = _cpu_layout()
    arena = _arena(layers)
    before = arena.clone()
    copier = BlockCopier(layers)
    for handle in (copier.load(arena, [], []), copier.save(arena, [], [])):
        assert isinstance(handle, CopyHandle) and handle.done()
        handle.wait()
    assert all(torch.count_nonzero(layer) == 0 for layer in layers)
    assert torch.equal(arena, before)


def test_cpu_handles_are_done_when_returned():
    layers = _cpu_layout()
    copier = BlockCopier(layers)
    handle = copier.load(_arena(layers), [1], [2])
    assert handle.done() and handle.event is None


@pytest.mark.parametrize("slots, block_ids", [([1, 2], [3]), ([1], [])])
def test_mismatched_lengths_are_refused(slots, block_ids):
    layers = _cpu_layout()
    copier = BlockCopier(layers)
    with pytest.raises(ValueError, match="one slot per block"):
        copier.load(_arena(layers), slots, block_ids)
    with pytest.raises(ValueError, match="one slot per block"):
        copier.save(_arena(layers), block_ids, slots)


def test_out_of_range_indices_are_refused_before_anything_is_copied():
    layers = _cpu_layout()
    arena = _arena(layers)
    copier = BlockCopier(layers)
    with pytest.raises(ValueError, match="arena slots must lie in"):
        copier.load(arena, [0, NUM_SLOTS], [0, 1])
    with pytest.raises(ValueError, match="engine block ids must lie in"):
        copier.load(arena, [0, 1], [0, -1])
    assert all(torch.count_nonzero(layer) == 0 for layer in layers)


def test_an_arena_viewed_for_another_shape_is_refused():
    layers = _cpu_layout()
    copier = BlockCopier(layers)
    wrong_layers = torch.zeros(NUM_SLOTS, NUM_LAYERS + 1, *layers[0].shape[1:], dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="this cache needs"):
        copier.load(wrong_layers, [0], [0])
    wrong_dtype = torch.zeros(NUM_SLOTS, NUM_LAYERS, *layers[0].shape[1:], dtype=torch.float32)
    with pytest.raises(ValueError, match="this cache needs"):
        copier.save(wrong_dtype, [0], [0])


def test_layers_of_different_shapes_are_refused():
    with pytest.raises(ValueError, match="share one block shape"):
        BlockCopier([torch.zeros(4, 2, 3), torch.zeros(4, 2, 4)])
    with pytest.raises(ValueError, match="at least one"):
        BlockCopier([])
    with pytest.raises(ValueError, match="staging_blocks"):
        BlockCopier(_cpu_layout(), staging_blocks=0)


def test_runs_group_steps_of_one_in_both_indices():
    assert _runs([2, 3, 4, 9, 1], [9, 10, 11, 0, 1]) == [(2, 9, 3), (9, 0, 1), (1, 1, 1)]
    assert _runs([5, 6], [3, 2]) == [(5, 3, 1), (6, 2, 1)]
    assert _runs([], []) == []


def test_pending_host_work_runs_in_order_on_done_and_wait():
    finished = []

    class FakeEvent:
        def __init__(self, ready: bool) -> None:
            self.ready = ready

        def query(self) -> bool:
            return self.ready

        def synchronize(self) -> None:
            self.ready = True

    first, second = FakeEvent(True), FakeEvent(False)
    handle = CopyHandle([kv_copy._Step(first, lambda: finished.append(1)),
                         kv_copy._Step(second, lambda: finished.append(2))], second)
    assert not handle.done() and finished == [1]
    handle.wait()
    assert handle.done() and finished == [1, 2]
