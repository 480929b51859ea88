"""The connector keys what it hashes itself under the request's salt segments: the offset rides
in the request's ``kv_transfer_params`` (``request_transfer_params``), and both the prompt it
hashes without the gateway's keys and the output blocks a finished request saves agree with
``kvstore.keys.prompt_block_keys`` under the same segments."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

pytest.importorskip(
    "vllm", reason="needs vllm, which is not installed (kvstore.connector is a vLLM KV connector)"
)

from kvstore.connector import PARAMS_KEY, BatonConnector, ConnectorStats, _RequestState  # noqa: E402
from kvstore.connector import request_transfer_params  # noqa: E402
from kvstore.keys import KeyExtras, block_keys, first_salted_block, prompt_block_keys  # noqa: E402
from protos.wire import EngineRequest, SamplingOptions  # noqa: E402

BS = 16
LAYOUT = "torch.float32:16"


def extras(salt: str, offset: int) -> KeyExtras:
    return KeyExtras("m", salt, "", LAYOUT, salt_from_block=first_salted_block(offset, BS))


class _Store:
    def __init__(self) -> None:
        self.reserved: list[tuple[list[bytes], list[bytes | None]]] = []

    def reserve_later(self, keys, parents):
        self.reserved.append((list(keys), list(parents)))
        return None


def scheduler_half() -> BatonConnector:
    connector = object.__new__(BatonConnector)
    connector._block_size, connector._model_id, connector._kv_layout = BS, "m", LAYOUT
    connector.stats, connector._store, connector._async = ConnectorStats(), _Store(), False
    connector._requests = {}
    return connector


def vllm_request(prompt: list[int], salt: str, offset: int | None, output: list[int] = ()):
    carried = {} if offset is None else {"cache_salt_offset": offset}
    return SimpleNamespace(request_id="r", prompt_token_ids=prompt, cache_salt=salt,
                           kv_transfer_params={PARAMS_KEY: carried},
                           all_token_ids=prompt + list(output),
                           num_computed_tokens=len(prompt) + len(output))


def test_the_runner_carries_the_salt_offset_only_when_there_is_one():
    sampling = SamplingOptions(max_tokens=1)
    assert request_transfer_params(EngineRequest("r", (1, 2), sampling, cache_salt="A")) is None
    carried = request_transfer_params(EngineRequest("r", (1, 2), sampling, cache_salt="A",
                                                    cache_salt_offset=2))
    assert carried == {PARAMS_KEY: {"cache_salt_offset": 2}}


@pytest.mark.parametrize("offset", [None, 0, 3 * BS, 3 * BS + 5, 5 * BS + 2])
def test_a_prompt_hashed_in_the_connector_is_keyed_under_its_segments(offset):
    prompt = list(range(5 * BS + 7))
    connector = scheduler_half()
    keys = connector._prompt_keys(vllm_request(prompt, "A", offset), prompt)
    assert keys == prompt_block_keys(prompt, BS, extras("A", offset or 0))
    assert connector.stats.hashed_prompts == 1
    if offset:
        trunk = block_keys(prompt, BS, KeyExtras("m", "", "", LAYOUT))[:offset // BS]
        assert keys[:offset // BS] == trunk and keys[offset // BS] not in trunk


@pytest.mark.parametrize("offset", [0, 2 * BS, 3 * BS, 3 * BS + 4])
def test_output_blocks_continue_the_segmented_chain(offset):
    """The reply's full blocks get the keys the next step's prompt (prompt + reply) hashes to:
    across the salted link when the offset falls in the prompt's tail."""
    prompt, output = list(range(3 * BS + 4)), list(range(1000, 1000 + 2 * BS))
    connector = scheduler_half()
    request = vllm_request(prompt, "A", offset, output)
    state = _RequestState(keys=prompt_block_keys(prompt, BS, extras("A", offset)),
                          num_prompt_tokens=len(prompt))
    save = connector._output_saves(request, state, list(range(10)))
    next_step = block_keys(prompt + output, BS, extras("A", offset))
    assert save.keys == next_step[3:5]
    assert save.parents == [next_step[2], next_step[3]]


def test_a_short_prompts_output_blocks_start_the_chain():
    prompt, output = [1, 2, 3], list(range(100, 100 + 2 * BS))
    connector = scheduler_half()
    request = vllm_request(prompt, "A", 2, output)
    state = _RequestState(keys=prompt_block_keys(prompt, BS, extras("A", 2)), num_prompt_tokens=3)
    save = connector._output_saves(request, state, list(range(4)))
    assert save.keys == block_keys(prompt + output, BS, extras("A", 2))[:2]
    assert save.parents[0] is None
