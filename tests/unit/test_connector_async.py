"""The worker half's asynchronous transfers, on CPU tensors with a store stand-in: a load is
reported finished (``get_finished``'s receiving set) only once its bytes are in the engine's
blocks, and a finished request's saves are reported (its blocks freed by vLLM) only once
written and committed. The copies are held back at will, so "reported early" cannot hide
behind a fast copy."""

from __future__ import annotations

import threading
import time

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip(
    "vllm", reason="needs vllm, which is not installed (kvstore.connector is a vLLM KV connector)"
)

from kvstore.client import StoreSlots  # noqa: E402
from kvstore.connector import (  # noqa: E402
    BatonConnector,
    BatonConnectorMetadata,
    BatonWorkerMetadata,
    ConnectorStats,
    LoadSpec,
    SaveSpec,
)
from kvstore.connector_meta import SaveLedger, StepGate  # noqa: E402
from kvstore.connector_worker import _Transfers  # noqa: E402
from kvstore.kv_copy import BlockCopier  # noqa: E402

NUM_LAYERS, NUM_BLOCKS, BLOCK_SHAPE, NUM_SLOTS = 3, 8, (2, 4, 5), 6
ARENA = "/dev/shm/test-arena"


class _Arena:
    def __init__(self) -> None:
        per_layer = torch.zeros(BLOCK_SHAPE).numel() * 4
        self.slot_bytes, self.num_slots = per_layer * NUM_LAYERS, NUM_SLOTS
        self.slots = torch.zeros(NUM_SLOTS, self.slot_bytes, dtype=torch.uint8)

    def view(self) -> torch.Tensor:
        return self.slots.view(torch.float32).view(NUM_SLOTS, NUM_LAYERS, *BLOCK_SHAPE)


class _Store:
    """Records the calls the worker half makes; grants what it is told to."""

    def __init__(self) -> None:
        self.arena = _Arena()
        self.released: list[list] = []
        self.committed: list[list] = []
        self.checksums: list[list[int] | None] = []  # sent with each commit
        self.grants: list[int | None] = []

    def arena_for(self, path):
        return self.arena if path == ARENA else None

    def release(self, keys, arena_path) -> None:
        self.released.append(list(keys))

    def reserve_many(self, chains):
        return [StoreSlots(ARENA, self.grants[: len(keys)]) for keys, _ in chains]

    def commit_later(self, keys, arena_path, on_lost=None, checksums=None) -> None:
        self.committed.append(list(keys))
        self.checksums.append(None if checksums is None else list(checksums))

    def abort(self, keys, arena_path) -> None:
        raise AssertionError("nothing is aborted here")


class _GatedCopier(BlockCopier):
    """A ``BlockCopier`` whose copies wait until the test opens the gate."""

    def __init__(self, layers, gate: threading.Event) -> None:
        super().__init__(layers)
        self.gate = gate
        self.loads: list[tuple[list[int], list[int]]] = []
        """(slots, block ids) of every ``load`` call, in order."""

    def load(self, arena_layers, slots, block_ids):
        self.gate.wait(10)
        self.loads.append((list(slots), list(block_ids)))
        return super().load(arena_layers, slots, block_ids)

    def save(self, arena_layers, block_ids, slots):
        self.gate.wait(10)
        return super().save(arena_layers, block_ids, slots)


def worker_half(gate: threading.Event) -> tuple[BatonConnector, _Store]:
    connector = object.__new__(BatonConnector)
    store = _Store()
    layers = [torch.zeros(NUM_BLOCKS, *BLOCK_SHAPE) for _ in range(NUM_LAYERS)]
    connector._store, connector._layers, connector._device = store, layers, torch.device("cpu")
    connector._num_gpu_blocks, connector._engine_id = NUM_BLOCKS, "test-engine"
    connector._arena_layers, connector._arena_layers_path = None, ""
    connector._load_errors, connector._step = set(), BatonWorkerMetadata()
    connector.stats, connector._async = ConnectorStats(), True
    connector._ledger, connector._transfers = SaveLedger(), _Transfers()
    connector._step_gate, connector._saves_after_outputs = StepGate(), True
    connector._arena_lock, connector._threads = threading.Lock(), {}
    connector._copiers = {direction: _GatedCopier(layers, gate)
                          for direction in ("load", "save", "step")}
    return connector, store


def step(connector: BatonConnector, meta: BatonConnectorMetadata,
         finished: set[str] = frozenset(), delivered: bool = True) -> tuple[set | None, set | None]:
    """One engine step as vLLM drives the worker half: metadata bound, loads started, saves
    handed off, then what finished; then, ``delivered``, the runner hands the step's outputs
    out and opens the step gate."""
    connector._connector_metadata = meta
    connector.start_load_kv(None)
    connector.wait_for_save()
    done = connector.get_finished(set(finished))
    connector._connector_metadata = None
    if delivered:
        connector._step_gate.open()
    return done


def reported(connector, first: tuple[set | None, set | None]):
    """What a step reported finished, or, when it reported nothing yet (the copy still runs),
    what a later step does: with the copy's gate open it may finish before the first
    ``get_finished``, and then it is reported only once."""
    return first if first != (None, None) else until(connector)


def until(connector, finished=frozenset(), timeout_s: float = 30.0):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        sending, recving = step(connector, BatonConnectorMetadata(), finished)
        if sending or recving:
            return sending, recving
        time.sleep(0.005)
    raise AssertionError("nothing was reported finished")


def test_a_load_is_reported_finished_only_once_its_bytes_are_in_the_engines_blocks():
    gate = threading.Event()
    connector, store = worker_half(gate)
    arena = store.arena.view()
    arena[2] = torch.randn(NUM_LAYERS, *BLOCK_SHAPE)
    arena[4] = torch.randn(NUM_LAYERS, *BLOCK_SHAPE)
    load = LoadSpec("r", block_ids=[5, 1], slots=[2, 4], keys=[b"k2", b"k4"], arena_path=ARENA,
                    unpin_also=[b"k0"], on_step=False)

    assert step(connector, BatonConnectorMetadata(loads=[load])) == (None, None)
    time.sleep(0.05)
    assert step(connector, BatonConnectorMetadata()) == (None, None)  # still copying
    assert all(not layer[5].any() and not layer[1].any() for layer in connector._layers)
    assert store.released == []  # pinned while the copy reads the slots

    gate.set()
    assert until(connector) == (None, {"r"})
    for index, layer in enumerate(connector._layers):
        assert torch.equal(layer[5], arena[2, index]) and torch.equal(layer[1], arena[4, index])
    assert store.released == [[b"k2", b"k4", b"k0"]]
    assert connector.stats.loaded_blocks == 2
    assert connector.get_block_ids_with_load_errors() == set()


def test_a_load_from_an_arena_that_is_gone_is_reported_with_its_blocks_to_recompute():
    gate = threading.Event()
    gate.set()
    connector, store = worker_half(gate)
    load = LoadSpec("r", block_ids=[3, 4], slots=[0, 1], keys=[b"a", b"b"], arena_path="/gone",
                    on_step=False)

    assert reported(connector, step(connector, BatonConnectorMetadata(loads=[load]))) == (None, {"r"})
    assert connector.get_block_ids_with_load_errors() == {3, 4}
    assert store.released == []  # the store that pinned them is gone, and its pins with it


def test_a_steps_loads_on_the_step_are_copied_in_one_call_before_the_forward_pass():
    """The step's on-step loads from one arena in one ``BlockCopier.load`` (each layer gathered
    and scattered once, not once per request), before the forward pass; one from an arena that
    is gone fails alone, its blocks to recompute; an asynchronous load of the same step is a
    job of its own, reported once its own bytes have landed."""
    gate = threading.Event()
    gate.set()
    connector, store = worker_half(gate)
    arena = store.arena.view()
    for slot in (0, 1, 3, 5):
        arena[slot] = torch.randn(NUM_LAYERS, *BLOCK_SHAPE)
    loads = [LoadSpec("a", block_ids=[2], slots=[1], keys=[b"k1"], arena_path=ARENA, on_step=True),
             LoadSpec("gone", block_ids=[4], slots=[2], keys=[b"x"], arena_path="/gone",
                      on_step=True),
             LoadSpec("later", block_ids=[0], slots=[5], keys=[b"k5"], arena_path=ARENA,
                      on_step=False),
             LoadSpec("b", block_ids=[7, 6], slots=[3, 0], keys=[b"k3", b"k0"], arena_path=ARENA,
                      unpin_also=[b"u"], on_step=True)]

    connector._connector_metadata = BatonConnectorMetadata(loads=loads)
    connector.start_load_kv(None)
    for index, layer in enumerate(connector._layers):  # landed before the forward pass
        assert torch.equal(layer[2], arena[1, index]) and torch.equal(layer[7], arena[3, index])
        assert torch.equal(layer[6], arena[0, index]) and not layer[4].any()
    assert store.released == [[b"k1", b"k3", b"k0", b"u"]]  # one release, in the step
    assert connector.get_block_ids_with_load_errors() == {4}
    assert connector._copiers["step"].loads == [([1, 3, 0], [2, 7, 6])]
    assert reported(connector, connector.get_finished(set())) == (None, {"later"})
    assert connector._copiers["load"].loads == [([5], [0])]  # the loading thread's own copier
    assert torch.equal(connector._layers[0][0], arena[5, 0])
    assert store.released == [[b"k1", b"k3", b"k0", b"u"], [b"k5"]]
    assert connector.stats.loaded_blocks == 4


def test_a_finished_requests_blocks_are_held_until_its_saves_are_written_and_committed():
    gate = threading.Event()
    connector, store = worker_half(gate)
    for index, layer in enumerate(connector._layers):
        layer[6] = torch.full(BLOCK_SHAPE, float(index + 1))
        layer[7] = torch.full(BLOCK_SHAPE, float(index + 10))
    store.grants = [3, None]  # the second block is in the store already
    save = SaveSpec("r", block_ids=[6, 7], keys=[b"x", b"y"], parents=[None, b"x"])

    assert step(connector, BatonConnectorMetadata(saves=[save]), finished={"r"}) == (None, None)
    time.sleep(0.05)
    assert step(connector, BatonConnectorMetadata()) == (None, None)  # vLLM keeps the blocks
    assert store.committed == [] and not store.arena.slots.any()
    assert len(connector._ledger.pending()) == 1

    gate.set()
    assert until(connector) == ({"r"}, None)
    assert store.committed == [[b"x"]]
    for index in range(NUM_LAYERS):
        assert torch.equal(store.arena.view()[3, index], connector._layers[index][6])
    assert connector._ledger.pending() == [] and connector._ledger.take_stored("r") == 1
    assert connector.stats.saved_blocks == 1


def _one_block_save(connector, store) -> SaveSpec:
    for index, layer in enumerate(connector._layers):
        layer[2] = torch.full(BLOCK_SHAPE, float(index + 1))
    store.grants = [1]
    return SaveSpec("r", block_ids=[2], keys=[b"s"], parents=[None])


def test_a_save_starts_writing_only_once_its_steps_outputs_are_handed_out(monkeypatch):
    """On a CPU engine the saving thread shares the engine's core: a save handed off after the
    forward pass waits until the runner has handed the step's outputs out (the step gate)."""
    monkeypatch.setattr("kvstore.connector_worker.SAVE_HOLD_MAX_S", 30.0)
    gate = threading.Event()
    gate.set()  # copies run at once: only the step gate holds the save
    connector, store = worker_half(gate)
    save = _one_block_save(connector, store)

    step(connector, BatonConnectorMetadata(saves=[save]), finished={"r"}, delivered=False)
    assert not connector._step_gate.is_open()
    time.sleep(0.1)
    assert store.committed == [] and not store.arena.slots.any()  # held: outputs not out yet

    connector._step_gate.open()  # the runner delivered the step's outputs
    assert until(connector) == ({"r"}, None)
    assert store.committed == [[b"s"]]
    for index in range(NUM_LAYERS):
        assert torch.equal(store.arena.view()[1, index], connector._layers[index][2])


def test_a_save_whose_step_gate_is_never_opened_starts_after_the_hold_bound():
    """An engine driven without Baton's runner (nobody opens the gate) still saves: each save
    at most ``SAVE_HOLD_MAX_S`` late."""
    gate = threading.Event()
    gate.set()
    connector, store = worker_half(gate)
    save = _one_block_save(connector, store)

    step(connector, BatonConnectorMetadata(saves=[save]), finished={"r"}, delivered=False)
    deadline = time.monotonic() + 30.0
    while not store.committed and time.monotonic() < deadline:
        time.sleep(0.005)  # no step runs meanwhile: nothing opens the gate
    assert store.committed == [[b"s"]]
    assert not connector._step_gate.is_open()


def test_a_prefill_engines_save_starts_at_once(monkeypatch):
    """A prefill engine's save is its hand-off: it is not held for the step's outputs."""
    monkeypatch.setattr("kvstore.connector_worker.SAVE_HOLD_MAX_S", 30.0)
    gate = threading.Event()
    gate.set()
    connector, store = worker_half(gate)
    connector._saves_after_outputs = False
    save = _one_block_save(connector, store)

    step(connector, BatonConnectorMetadata(saves=[save]), finished={"r"}, delivered=False)
    assert connector._step_gate.is_open()  # never closed
    deadline = time.monotonic() + 10.0
    while not store.committed and time.monotonic() < deadline:
        time.sleep(0.005)
    assert store.committed == [[b"s"]]


def test_a_commit_carries_each_saved_blocks_checksum_as_written():
    """Hashed once, by the writer: the store keeps them for its serves and demotions."""
    from kvstore.transfer_wire import block_checksum

    gate = threading.Event()
    gate.set()
    connector, store = worker_half(gate)
    for index, layer in enumerate(connector._layers):
        for block in range(NUM_BLOCKS):
            layer[block] = torch.full(BLOCK_SHAPE, float(10 * block + index))
    store.grants = [4, 1]
    save = SaveSpec("r", block_ids=[5, 2], keys=[b"x", b"y"], parents=[None, b"x"])
    first = step(connector, BatonConnectorMetadata(saves=[save]), finished={"r"})
    assert reported(connector, first) == ({"r"}, None)
    assert store.committed == [[b"x", b"y"]]
    expected = [block_checksum(torch.stack([layer[block] for layer in connector._layers])
                               .view(torch.uint8).numpy()) for block in (5, 2)]
    assert store.checksums == [expected]
    assert expected == [block_checksum(store.arena.slots[slot].numpy()) for slot in (4, 1)]
    assert expected[0] != expected[1]


def test_a_save_that_fails_gives_back_its_slots_and_those_after_it_and_commits_those_before():
    """One step's saves, the second's copy failing: the first is committed, the second's and
    the third's reservations are aborted (a live process never leaves slots reserved), and
    every request is still reported finished, so vLLM frees its blocks."""
    gate = threading.Event()  # closed while the saves are handed off, so none is reported yet
    connector, store = worker_half(gate)
    aborted: list[list] = []
    store.abort = lambda keys, arena_path: aborted.append(list(keys))
    copier, calls = connector._copiers["save"], []
    real_save = copier.save

    def save_failing_second(arena_layers, block_ids, slots):
        calls.append(list(block_ids))
        if len(calls) == 2:
            raise RuntimeError("copy failed")
        return real_save(arena_layers, block_ids, slots)

    copier.save = save_failing_second
    store.grants = [1, 2]
    saves = [SaveSpec(r, block_ids=[i], keys=[f"{r}0".encode()], parents=[None])
             for i, r in enumerate(("a", "b", "c"))]

    assert step(connector, BatonConnectorMetadata(saves=saves),
                finished={"a", "b", "c"}) == (None, None)
    gate.set()
    assert until(connector) == ({"a", "b", "c"}, None)
    assert calls == [[0], [1]]  # the third was never copied
    assert store.committed == [[b"a0"]]
    assert aborted == [[b"b0"], [b"c0"]]


def test_a_request_with_nothing_to_save_is_never_reported_as_sending():
    gate = threading.Event()
    gate.set()
    connector, store = worker_half(gate)
    assert step(connector, BatonConnectorMetadata(), finished={"other"}) == (None, None)


def test_a_load_cheap_enough_is_copied_on_the_step_before_the_forward_pass():
    """Copied inside ``start_load_kv`` (vLLM runs it before the forward pass when a step has
    such a load) and never reported as an asynchronous load."""
    gate = threading.Event()
    gate.set()
    connector, store = worker_half(gate)
    store.arena.view()[1] = torch.randn(NUM_LAYERS, *BLOCK_SHAPE)
    load = LoadSpec("r", block_ids=[2], slots=[1], keys=[b"k1"], arena_path=ARENA, on_step=True)

    connector._connector_metadata = BatonConnectorMetadata(loads=[load])
    connector.start_load_kv(None)
    for index, layer in enumerate(connector._layers):  # landed before the forward pass
        assert torch.equal(layer[2], store.arena.view()[1, index])
    assert store.released == [[b"k1"]]
    assert connector.get_finished(set()) == (None, None)


class _Slots:
    slot_bytes = 1_000_000


def scheduler_half(stepping: bool, step_s: float, loaded_bytes: int = 0,
                   load_seconds: float = 0.0, sync_load_fraction: float = 0.1) -> BatonConnector:
    connector = object.__new__(BatonConnector)
    connector._stepping, connector._step_s = stepping, step_s
    connector._sync_load_fraction = sync_load_fraction  # engine.kv_sync_load_step_fraction
    connector.stats = ConnectorStats(loaded_bytes=loaded_bytes, load_seconds=load_seconds)
    connector._store = type("S", (), {"arena": _Slots()})()
    return connector


def test_a_load_goes_on_the_step_only_when_it_costs_the_running_sequences_little():
    # nothing running: on the step, whatever its size
    assert scheduler_half(False, 0.05)._cheap_on_step(10_000)
    # a measured 1 GB/s and 100 ms steps: up to 10 ms of copying (10 blocks of 1 MB) on the step
    busy = scheduler_half(True, 0.1, loaded_bytes=10**9, load_seconds=1.0)
    assert busy._cheap_on_step(10) and not busy._cheap_on_step(11)
    # before any measurement the assumed speed (2 GB/s) decides
    assert scheduler_half(True, 0.1)._cheap_on_step(20)
    assert not scheduler_half(True, 0.1)._cheap_on_step(21)
    # the knob moves the line: 5% of the step is half as many blocks; 0 puts every load off it
    assert scheduler_half(True, 0.1, sync_load_fraction=0.05)._cheap_on_step(10)
    assert not scheduler_half(True, 0.1, sync_load_fraction=0.05)._cheap_on_step(11)
    assert not scheduler_half(True, 0.1, sync_load_fraction=0.0)._cheap_on_step(1)


def test_the_connector_knobs_reach_the_connectors_extra_config(tiny_model):
    from engine.builder import build_engine_args
    from engine.config import EngineConfig
    from kvstore.attach import StoreWiring

    model = tiny_model
    config = EngineConfig(kv_sync_load_step_fraction=0.2, kv_lookup_wait_step_fraction=0.01,
                          kv_lookup_wait_max_ms=7.0)
    args = build_engine_args(config, model, "decode", "e0", StoreWiring("store", "ns", "node"))
    extra = args.kv_transfer_config.kv_connector_extra_config
    assert (extra["sync_load_step_fraction"], extra["lookup_wait_step_fraction"],
            extra["lookup_wait_max_s"]) == (0.2, 0.01, 0.007)
    # a prompt saved whole is the decode role's choice; prefill engines always save per step
    whole, steps = EngineConfig(), EngineConfig(decode_saves="per_step")
    wiring = StoreWiring("store", "ns", "node")
    assert [build_engine_args(c, model, role, "e0", wiring).kv_transfer_config
            .kv_connector_extra_config["save_whole_prompts"]
            for c, role in ((whole, "decode"), (whole, "prefill"), (steps, "decode"))
            ] == [True, False, False]
    # a decode engine's saves wait for its step's outputs; a prefill engine's are its hand-off
    assert [build_engine_args(EngineConfig(), model, role, "e0", wiring).kv_transfer_config
            .kv_connector_extra_config["saves_after_outputs"] for role in ("decode", "prefill")
            ] == [True, False]


def test_an_engine_that_saves_no_prompts_only_loads(tiny_model):
    """``EngineConfig.saves_prompts`` decides both the connector's role and what the worker
    announces to the conductor (``Registration.saves_prompts``)."""
    from engine.builder import build_engine_args
    from engine.config import EngineConfig
    from kvstore.attach import StoreWiring

    wiring = StoreWiring("store", "ns", "node")
    cases = [(EngineConfig(), "prefill"), (EngineConfig(), "decode"),
             (EngineConfig(decode_saves="per_step"), "decode"),
             (EngineConfig(decode_saves="none"), "decode"), (EngineConfig(decode_saves="none"), "prefill")]
    assert [c.saves_prompts(role) for c, role in cases] == [True, True, True, False, True]
    assert [build_engine_args(c, tiny_model, role, "e0", wiring).kv_transfer_config.kv_role
            for c, role in cases] == ["kv_both", "kv_both", "kv_both", "kv_consumer", "kv_both"]


def test_the_engines_kv_block_size_reaches_vllm_and_the_peers_servers(tiny_model):
    """One block size for Baton's engines, its store and conductor, and SMG's vLLM servers in
    ``baton bench peers`` (the same engine arguments): 32 tokens on a CPU, 16 on CUDA, or
    the configured size."""
    from bench.peers_stacks import vllm_server_argv
    from engine.builder import build_engine_args
    from engine.config import EngineConfig
    from kvstore.attach import StoreWiring

    wiring = StoreWiring("store", "ns", "node")
    configs = [EngineConfig(), EngineConfig(device="cuda"), EngineConfig(block_size_tokens=64)]
    assert [build_engine_args(c, tiny_model, "decode", "e0", wiring).block_size for c in configs] == [32, 16, 64]
    argvs = [vllm_server_argv(tiny_model, c, 9) for c in configs]
    assert [argv[argv.index("--block-size") + 1] for argv in argvs] == ["32", "16", "64"]
    with pytest.raises(ValueError):
        EngineConfig(block_size_tokens=0)


def test_the_engines_step_budget_reaches_vllm(tiny_model):
    from engine.builder import build_engine_args
    from engine.config import EngineConfig
    from kvstore.attach import StoreWiring

    wiring = StoreWiring("store", "ns", "node")

    def budget(config: EngineConfig, role: str) -> int | None:
        return build_engine_args(config, tiny_model, role, "e0", wiring).max_num_batched_tokens

    # on a CPU an engine that decodes chunks prompts in 512-token steps; a prefill engine and
    # a CUDA engine keep vLLM's own default, and a configured budget goes to every role
    assert (budget(EngineConfig(), "decode"), budget(EngineConfig(), "prefill")) == (512, None)
    assert budget(EngineConfig(device="cuda"), "decode") is None
    configured = EngineConfig(max_num_batched_tokens=256)
    assert (budget(configured, "decode"), budget(configured, "prefill")) == (256, 256)
