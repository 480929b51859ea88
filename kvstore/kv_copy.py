"""Block copies between an engine's paged KV cache and the host arena, batched over all layers.

``BlockCopier.load`` copies arena slots into engine blocks; ``BlockCopier.save`` copies engine
blocks into arena slots. Both return a ``CopyHandle`` at once; ``done()`` asks without blocking,
``wait()`` blocks until the bytes have landed. Imports only torch, so the copy path runs (and
``bench.kvcopy`` measures it) on a bare GPU machine.

Layouts: ``layers`` are the engine's per-layer caches with the block dimension first,
``[num_blocks, *block_shape]`` (views may be transposed, e.g. from vLLM's GPU layout
``[2, num_blocks, block_size, kv_heads, head_dim]``); ``arena_layers`` is the host arena viewed
``[num_slots, num_layers, *block_shape]`` in the cache's dtype, so one slot holds one block of
every layer, contiguously.

On CUDA the copies run on one dedicated stream, ordered after the work already queued on the
caller's current stream (a save reads what the forward pass wrote), in chunks of at most
``staging_blocks`` blocks:

- when the arena can be page-locked in place (``cudaHostRegister``), host <-> device copies go
  straight between the arena's slots (one copy per run of consecutive slots) and a device
  staging buffer, and nothing on the host waits: the handle is one event;
- otherwise each chunk goes through one of two pinned staging buffers (double-buffered: the host
  gathers chunk k+1 while chunk k crosses the bus); a load returns once its last chunk has been
  gathered and queued, a save's last host scatter runs in ``done()``/``wait()``.

On the device each layer is one ``index_copy_``/``index_select`` per chunk, on the copy stream.
On CPU (vLLM-CPU, tests) there is no staging: the arena and the cache are both host memory and
the copy completes inside ``load``/``save``.

Contract for the caller: a load's blocks must not be read by the engine before its handle is
done (or the compute stream waits on ``CopyHandle.event``); a save's blocks must not be
overwritten before its handle is done; the arena must stay mapped until every handle that names
it is done. ``close()`` waits for everything and unregisters the arenas it page-locked.
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable, Sequence

import torch

DEFAULT_STAGING_BLOCKS = 64
# On CPU, per-block copy_ calls beat gather-then-scatter for blocks at least this large (one copy
# instead of two); below it the Python loop's overhead wins out (measured on 2 cores: 96 KiB
# layer blocks 8.9 vs 6.7 GB/s, 12 KiB blocks 2.7 vs 6.4 GB/s).
CPU_PER_BLOCK_MIN_BYTES = 64 * 1024


class _Step:
    """One queued piece of a copy: an event to wait for, then optional host work to finish it."""

    __slots__ = ("event", "finish", "finished")

    def __init__(self, event: torch.cuda.Event | None, finish: Callable[[], None] | None) -> None:
        self.event = event
        self.finish = finish
        self.finished = False

    def ready(self) -> bool:
        return self.finished or self.event is None or self.event.query()

    def complete(self) -> None:
        if self.finished:
            return
        if self.event is not None:
            self.event.synchronize()
        if self.finish is not None:
            self.finish()
        self.finished = True


class CopyHandle:
    """A copy in flight. ``done()`` never blocks; ``wait()`` returns when every byte has landed.

    ``event`` is the CUDA event recorded after the copy's last device work (None on CPU, or for
    an empty copy): a stream can ``wait_event`` on it instead of the host waiting."""

    def __init__(self, steps: Sequence[_Step] = (), event: torch.cuda.Event | None = None) -> None:
        self._steps = list(steps)
        self.event = event

    def done(self) -> bool:
        while self._steps and self._steps[0].ready():
            self._steps.pop(0).complete()
        return not self._steps

    def wait(self) -> None:
        while self._steps:
            self._steps.pop(0).complete()


def _cuda_get_last_error() -> Callable[[], int] | None:
    """The loaded libcudart's ``cudaGetLastError`` (found in ``/proc/self/maps``), or None."""
    candidates: list[str | None] = []
    try:
        with open("/proc/self/maps") as maps:
            candidates += sorted({line.split()[-1] for line in maps if "libcudart" in line})
    except OSError:
        pass
    candidates.append(None)  # the process's global symbols
    for path in candidates:
        try:
            return ctypes.CDLL(path).cudaGetLastError
        except (AttributeError, OSError):
            continue
    return None


def _runs(src: Sequence[int], dst: Sequence[int]) -> list[tuple[int, int, int]]:
    """``(src_start, dst_start, length)`` for each maximal run where both indices step by one."""
    runs: list[tuple[int, int, int]] = []
    for s, d in zip(src, dst):
        if runs:
            s0, d0, n = runs[-1]
            if s == s0 + n and d == d0 + n:
                runs[-1] = (s0, d0, n + 1)
                continue
        runs.append((s, d, 1))
    return runs


class BlockCopier:
    """Copies blocks of every layer in ``layers`` to and from host arenas (see the module doc).

    ``staging_blocks`` bounds a chunk (and the staging memory: on CUDA, two pinned host buffers
    and one device buffer of ``staging_blocks`` blocks of all layers each); a bigger request is
    copied in chunks. ``register_arena`` lets CUDA runs page-lock an arena in place instead of
    staging through pinned buffers; it falls back to staging where the driver refuses."""

    def __init__(self, layers: list[torch.Tensor], staging_blocks: int = DEFAULT_STAGING_BLOCKS,
                 register_arena: bool = True) -> None:
        if not layers:
            raise ValueError("BlockCopier needs at least one KV cache layer")
        if staging_blocks < 1:
            raise ValueError(f"staging_blocks must be at least 1, got {staging_blocks}")
        block_shape = tuple(layers[0].shape[1:])
        for layer in layers:
            if (tuple(layer.shape[1:]) != block_shape or layer.dtype != layers[0].dtype
                    or layer.device != layers[0].device):
                raise ValueError(
                    "every KV cache layer must share one block shape, dtype and device; got "
                    f"{tuple(layer.shape[1:])}/{layer.dtype}/{layer.device} and "
                    f"{block_shape}/{layers[0].dtype}/{layers[0].device}")
        self.layers = layers
        self.block_shape = block_shape
        self.dtype = layers[0].dtype
        self.device = layers[0].device
        self.num_blocks = layers[0].shape[0]
        self.staging_blocks = staging_blocks
        self.block_bytes = layers[0][0].numel() * layers[0].element_size() * len(layers)
        self._cuda = self.device.type == "cuda"
        self._register = register_arena and self._cuda
        self._registered: dict[tuple[int, int], bool] = {}  # (data_ptr, nbytes) -> page-locked
        self._per_block_cpu = layers[0][0].numel() * layers[0].element_size() >= (
            CPU_PER_BLOCK_MIN_BYTES)
        if self._cuda:
            staging_shape = (staging_blocks, len(layers), *block_shape)
            self._stream = torch.cuda.Stream(device=self.device)
            with torch.cuda.stream(self._stream):
                self._device_staging = torch.empty(staging_shape, dtype=self.dtype,
                                                   device=self.device)
            self._host_staging = [torch.empty(staging_shape, dtype=self.dtype, pin_memory=True)
                                  for _ in range(2)]
            self._host_busy: list[_Step | None] = [None, None]  # the last step using each buffer
            self._next_buffer = 0

    # -- the API ------------------------------------------------------------------------------

    def load(self, arena_layers: torch.Tensor, slots: Sequence[int],
             block_ids: Sequence[int]) -> CopyHandle:
        """Copy arena ``slots[i]`` into engine block ``block_ids[i]`` for every layer."""
        slots, block_ids = self._check(arena_layers, slots, block_ids)
        if not slots:
            return CopyHandle()
        if not self._cuda:
            self._cpu_copy(arena_layers, slots, block_ids, load=True)
            return CopyHandle()
        return self._cuda_load(arena_layers, slots, block_ids)

    def save(self, arena_layers: torch.Tensor, block_ids: Sequence[int],
             slots: Sequence[int]) -> CopyHandle:
        """Copy engine block ``block_ids[i]`` into arena ``slots[i]`` for every layer."""
        slots, block_ids = self._check(arena_layers, slots, block_ids)
        if not slots:
            return CopyHandle()
        if not self._cuda:
            self._cpu_copy(arena_layers, slots, block_ids, load=False)
            return CopyHandle()
        return self._cuda_save(arena_layers, block_ids, slots)

    def close(self) -> None:
        """Wait for every copy in flight and unregister the arenas this copier page-locked."""
        if not self._cuda:
            return
        for step in self._host_busy:
            if step is not None:
                step.complete()
        self._stream.synchronize()
        cudart = torch.cuda.cudart()
        for (ptr, _), registered in self._registered.items():
            if registered:
                cudart.cudaHostUnregister(ptr)
        self._registered.clear()

    # -- checks -------------------------------------------------------------------------------

    def _check(self, arena_layers: torch.Tensor, slots: Sequence[int],
               block_ids: Sequence[int]) -> tuple[list[int], list[int]]:
        slots, block_ids = [int(s) for s in slots], [int(b) for b in block_ids]
        if len(slots) != len(block_ids):
            raise ValueError(f"got {len(slots)} arena slots for {len(block_ids)} engine blocks: "
                             "pass one slot per block")
        expected = (len(self.layers), *self.block_shape)
        if tuple(arena_layers.shape[1:]) != expected or arena_layers.dtype != self.dtype:
            raise ValueError(
                f"the arena is viewed as {tuple(arena_layers.shape)} {arena_layers.dtype}; this "
                f"cache needs [num_slots, {', '.join(map(str, expected))}] {self.dtype}")
        if arena_layers.device.type != "cpu":
            raise ValueError(f"the arena must be host memory, not {arena_layers.device}")
        if slots and (min(slots) < 0 or max(slots) >= arena_layers.shape[0]):
            raise ValueError(f"arena slots must lie in [0, {arena_layers.shape[0]}); got "
                             f"{min(slots)}..{max(slots)}")
        if block_ids and (min(block_ids) < 0 or max(block_ids) >= self.num_blocks):
            raise ValueError(f"engine block ids must lie in [0, {self.num_blocks}); got "
                             f"{min(block_ids)}..{max(block_ids)}")
        return slots, block_ids

    # -- CPU: straight between the arena and the cache ----------------------------------------

    def _cpu_copy(self, arena_layers: torch.Tensor, slots: list[int], block_ids: list[int],
                  load: bool) -> None:
        if self._per_block_cpu:  # one copy_ per run of consecutive slots and blocks, per layer
            for slot, block, n in _runs(slots, block_ids):
                stacked = arena_layers[slot:slot + n]
                for index, layer in enumerate(self.layers):
                    if load:
                        layer[block:block + n].copy_(stacked[:, index])
                    else:
                        stacked[:, index].copy_(layer[block:block + n])
            return
        slot_index = torch.tensor(slots, dtype=torch.long)
        block_index = torch.tensor(block_ids, dtype=torch.long)
        for index, layer in enumerate(self.layers):
            if load:
                layer.index_copy_(0, block_index, arena_layers[:, index].index_select(0, slot_index))
            else:
                arena_layers[:, index].index_copy_(0, slot_index, layer.index_select(0, block_index))

    # -- CUDA ---------------------------------------------------------------------------------

    def _page_locked(self, arena_layers: torch.Tensor) -> bool:
        """Whether ``arena_layers`` is page-locked in place (registering it on first sight).

        A refused ``cudaHostRegister`` leaves its error as the thread's last CUDA error, which
        torch's next kernel-launch check would raise; registration is only tried where
        ``cudaGetLastError`` can be called to clear it."""
        if not self._register or not arena_layers.is_contiguous():
            return False
        key = (arena_layers.data_ptr(), arena_layers.numel() * arena_layers.element_size())
        if key not in self._registered:
            clear_error = _cuda_get_last_error()
            registered = False
            if clear_error is not None:
                error = torch.cuda.cudart().cudaHostRegister(key[0], key[1], 0)
                registered = int(error) == 0
                if not registered:
                    clear_error()
            self._registered[key] = registered
        return self._registered[key]

    def _chunks(self, n: int) -> list[tuple[int, int]]:
        return [(start, min(start + self.staging_blocks, n))
                for start in range(0, n, self.staging_blocks)]

    def _take_host_buffer(self) -> int:
        """A pinned staging buffer no queued step still uses (waiting for the older one)."""
        buffer = self._next_buffer
        self._next_buffer ^= 1
        step = self._host_busy[buffer]
        if step is not None:
            step.complete()
            self._host_busy[buffer] = None
        return buffer

    def _cuda_load(self, arena_layers: torch.Tensor, slots: list[int],
                   block_ids: list[int]) -> CopyHandle:
        direct = self._page_locked(arena_layers)
        self._stream.wait_stream(torch.cuda.current_stream(self.device))
        steps: list[_Step] = []
        event = None
        for start, end in self._chunks(len(slots)):
            n = end - start
            chunk_slots = slots[start:end]
            staged = self._device_staging[:n]
            host = None
            if not direct:
                buffer = self._take_host_buffer()
                host = self._host_staging[buffer][:n]
                torch.index_select(arena_layers, 0, torch.tensor(chunk_slots, dtype=torch.long),
                                   out=host)
            with torch.cuda.stream(self._stream):
                if direct:
                    for slot, position, length in _runs(chunk_slots, range(n)):
                        staged[position:position + length].copy_(
                            arena_layers[slot:slot + length], non_blocking=True)
                else:
                    staged.copy_(host, non_blocking=True)
                    host_done = torch.cuda.Event()
                    host_done.record(self._stream)
                    self._host_busy[buffer] = _Step(host_done, None)
                ids = torch.tensor(block_ids[start:end], dtype=torch.long).to(
                    self.device, non_blocking=True)
                for index, layer in enumerate(self.layers):
                    layer.index_copy_(0, ids, staged[:, index])
                event = torch.cuda.Event()
                event.record(self._stream)
            steps.append(_Step(event, None))
        return CopyHandle(steps, event)

    def _cuda_save(self, arena_layers: torch.Tensor, block_ids: list[int],
                   slots: list[int]) -> CopyHandle:
        direct = self._page_locked(arena_layers)
        self._stream.wait_stream(torch.cuda.current_stream(self.device))
        steps: list[_Step] = []
        event = None
        for start, end in self._chunks(len(slots)):
            n = end - start
            chunk_slots = slots[start:end]
            staged = self._device_staging[:n]
            buffer = None if direct else self._take_host_buffer()
            with torch.cuda.stream(self._stream):
                ids = torch.tensor(block_ids[start:end], dtype=torch.long).to(
                    self.device, non_blocking=True)
                for index, layer in enumerate(self.layers):
                    staged[:, index].copy_(layer.index_select(0, ids))
                if direct:
                    for slot, position, length in _runs(chunk_slots, range(n)):
                        arena_layers[slot:slot + length].copy_(
                            staged[position:position + length], non_blocking=True)
                else:
                    host = self._host_staging[buffer][:n]
                    host.copy_(staged, non_blocking=True)
                event = torch.cuda.Event()
                event.record(self._stream)
            if direct:
                steps.append(_Step(event, None))
                continue
            slot_index = torch.tensor(chunk_slots, dtype=torch.long)
            step = _Step(event, lambda host=host, slot_index=slot_index:
                         arena_layers.index_copy_(0, slot_index, host))
            self._host_busy[buffer] = step
            steps.append(step)
        return CopyHandle(steps, event)
