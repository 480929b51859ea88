"""What the connector reports for one request travels in vLLM's own mechanism: the worker
half's news of a step (``BatonWorkerMetadata``, handed to ``update_connector_output``) adjusts
the scheduler half's per-request state, and ``request_finished`` returns it as the request's
``kv_transfer_params``, which ``request_transfer`` reads back from the last ``RequestOutput``.
Also what the runner hands vLLM per request (``request_transfer_params``)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

pytest.importorskip(
    "vllm", reason="needs vllm, which is not installed (kvstore.connector is a vLLM KV connector)"
)

from kvstore.client import PendingSlots, StoreSlots  # noqa: E402
from kvstore.connector import (  # noqa: E402
    PARAMS_KEY,
    BatonConnector,
    BatonWorkerMetadata,
    RequestTransfer,
    _RequestState,
    request_transfer,
    request_transfer_params,
)
from protos.wire import EngineRequest, PromptBlocks, SamplingOptions  # noqa: E402


class _NoStore:
    def release(self, keys, arena_path) -> None:
        assert not keys


def scheduler_half(states: dict[str, _RequestState]) -> BatonConnector:
    """The scheduler half's bookkeeping alone (no engine, no store)."""
    connector = object.__new__(BatonConnector)
    connector._requests, connector._store = states, _NoStore()
    connector._lookups_unsent, connector._final_saves, connector._saves = [], [], False
    connector._async, connector._releases = False, {}
    return connector


def granted(*slots) -> PendingSlots:
    return PendingSlots(None, None, "arena", (), StoreSlots("arena", list(slots)))


def finished_output(connector: BatonConnector, request_id: str) -> SimpleNamespace:
    _free_later, params = connector.request_finished(SimpleNamespace(request_id=request_id), [])
    return SimpleNamespace(kv_transfer_params=params)


def test_a_request_reports_what_it_loaded_and_the_blocks_it_was_granted_to_store():
    state = _RequestState(keys=[], num_prompt_tokens=300, num_loaded_tokens=299,
                          reservations=[granted(4, None, 5), granted(6)])
    connector = scheduler_half({"r-1": state})

    assert request_transfer(finished_output(connector, "r-1")) == RequestTransfer(299, 3)
    assert connector._requests == {}


def test_the_worker_halfs_news_reach_the_request_before_it_finishes():
    states = {name: _RequestState(keys=[], num_prompt_tokens=300, num_loaded_tokens=299,
                                  reservations=[granted(1, 2, 3)]) for name in ("a", "b")}
    connector = scheduler_half(states)
    news = BatonWorkerMetadata(failed_loads={"a"}, dropped_blocks={"b": 2}).aggregate(
        BatonWorkerMetadata(dropped_blocks={"b": 1, "gone": 5}))

    connector.update_connector_output(SimpleNamespace(kv_connector_worker_meta=news))

    assert request_transfer(finished_output(connector, "a")) == RequestTransfer(0, 3)
    assert request_transfer(finished_output(connector, "b")) == RequestTransfer(299, 0)


def test_a_store_gone_at_reservation_stores_nothing_and_other_outputs_report_zeros():
    lost = PendingSlots(None, None, "", (), StoreSlots("", [None, None]))
    connector = scheduler_half({"r": _RequestState(keys=[], num_prompt_tokens=10,
                                                   reservations=[lost])})
    assert request_transfer(finished_output(connector, "r")) == RequestTransfer(0, 0)
    assert request_transfer(SimpleNamespace(kv_transfer_params=None)) == RequestTransfer()
    assert request_transfer(SimpleNamespace(kv_transfer_params={"other": 1})) == RequestTransfer()


def test_the_runner_carries_the_gateways_keys_and_the_lookup_flag_and_nothing_else():
    sampling = SamplingOptions(max_tokens=1)
    bare = EngineRequest("r", (1, 2, 3), sampling)
    assert request_transfer_params(bare) is None  # a plain engine gets no kv_transfer_params
    blocks = PromptBlocks("m", "torch.float32:128", b"k" * 16, 128, 0)
    carried = request_transfer_params(EngineRequest("r", (1, 2, 3), sampling, blocks=blocks,
                                                    store_lookup=False))
    assert carried == {PARAMS_KEY: {"model_id": "m", "kv_layout": "torch.float32:128",
                                    "block_size": 128, "keys": b"k" * 16, "lookup": False}}


def _stepped(connector: BatonConnector, req_id: str, computed: int, scheduled: int,
             new_blocks: list[int], first: bool) -> list:
    """One scheduled step of ``req_id`` (its first, or a later chunk), as vLLM's
    ``SchedulerOutput`` names it; the saves the step's metadata hands the worker half."""
    new = [SimpleNamespace(req_id=req_id, block_ids=(new_blocks,), num_computed_tokens=computed)]
    cached = SimpleNamespace(req_ids=[] if first else [req_id],
                             new_block_ids=[] if first else [(new_blocks,)],
                             resumed_req_ids=set(), num_computed_tokens=[] if first else [computed])
    output = SimpleNamespace(total_num_scheduled_tokens=scheduled,
                             scheduled_new_reqs=new if first else [],
                             scheduled_cached_reqs=cached, num_scheduled_tokens={req_id: scheduled})
    return connector.build_connector_meta(output).saves


@pytest.mark.parametrize("whole_prompts", [False, True])
def test_a_decode_engine_saves_a_prompt_step_by_step_or_in_one_save_when_it_is_done(whole_prompts):
    # a 40-token prompt in 16-token blocks (2 full blocks and a tail), computed in 3 chunks of 16
    keys = [f"k{i}" for i in range(3)]
    state = _RequestState(keys=keys, num_prompt_tokens=40)
    connector = scheduler_half({"r-1": state})
    connector._saves, connector._block_size, connector._async = True, 16, True
    connector._loads_ready, connector._stepping, connector._step_s = [], False, 0.05
    connector._last_meta_at = 0.0
    connector._save_whole_prompts = whole_prompts

    steps = [_stepped(connector, "r-1", 0, 16, [7], first=True),
             _stepped(connector, "r-1", 16, 16, [8], first=False),
             _stepped(connector, "r-1", 32, 8, [9], first=False)]

    saved = [[(s.keys, s.block_ids) for s in saves] for saves in steps]
    if whole_prompts:
        assert saved == [[], [], [(keys, [7, 8, 9])]]
    else:
        assert saved == [[(["k0"], [7])], [(["k1"], [8])], [(["k2"], [9])]]
    assert state.saved_blocks == 3 and state.has_saves
