"""The real SMG router (PyPI ``smg==1.13.0``, its gRPC worker mode) in front of a whole Baton
cluster through Baton's engine gRPC contract (``engine_grpc.port``): a greedy chat completion over
SMG's OpenAI endpoint is Baton's own OpenAI front's answer token for token (colocated and
disaggregated prompts), ``n`` choices in one call, it streams, a client that goes away
mid-stream aborts the request inside Baton, GetLoads sees the running request, and
SubscribeKvEvents delivers the engines' blocks.
Tiny random model (its text is noise: the comparison is over tokens and their log-probabilities);
the cluster's fronts require an API key, and the engine contract serves without one
(``engine_grpc.require_api_key: false``): SMG 1.13 sends no key to its gRPC workers."""

from __future__ import annotations

import asyncio
import json
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import grpc
import httpx
import pytest
import pytest_asyncio
from smg_grpc_proto import vllm_engine_pb2 as vpb
from smg_grpc_proto import vllm_engine_pb2_grpc as vpb_grpc
from smg_grpc_proto.generated import common_pb2 as cpb

from gateway.sessions import scoped_session_id
from gateway.tokenization import PromptTokenizer
from tests.integration.engines import running_server

pytestmark = [pytest.mark.engine, pytest.mark.vllm, pytest.mark.asyncio(loop_scope="session")]

API_KEY = "engine-grpc-test-key"
LOGPROB_TOLERANCE = 1e-4
"""Both answers come from the same engines; SMG relays the engine's float32 log-probabilities."""
SHORT = "Why is the sky blue?"
LONG = " ".join(f"word{i}" for i in range(150))  # over short_prefill_tokens: prefilled apart
UNSEEN = " ".join(f"fresh{i}" for i in range(150))  # blocks no engine holds yet: stored events


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def server(tiny_model, tmp_path_factory):
    keys = tmp_path_factory.mktemp("engine-grpc") / "api.keys"
    keys.write_text(f"{API_KEY}\n")
    async with running_server({"engine.model": "tiny", "engine_grpc.port": 0,
                               "auth.api_key_file": str(keys), "name": "enginegrpc",
                               "engine_grpc.require_api_key": False,
                               "kvstore.host_capacity_bytes": 64 << 20,
                               # the older rule, named: SHORT co-located, LONG disaggregated
                               "conductor.tuning.short_prefill_tokens": 256}) as srv:
        yield srv


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def smg(server, tiny_model, tmp_path_factory):
    """``smg launch`` pointed at Baton's engine contract; its OpenAI base URL. (Async: the
    cluster's fronts answer SMG on this event loop.)"""
    binary = shutil.which("smg") or str(Path(sys.executable).with_name("smg"))
    assert Path(binary).exists(), "no smg router: scripts/setup.sh installs it (the test extra)"
    port = _free_port()
    log = tmp_path_factory.mktemp("smg") / "smg.log"
    with open(log, "w") as out:
        proc = subprocess.Popen(
            [binary, "launch", "--worker-urls",
             f"grpc://127.0.0.1:{server.fronts.engine_contract.port}",
             "--model-path", str(tiny_model.path), "--host", "127.0.0.1", "--port", str(port),
             "--prometheus-host", "127.0.0.1", "--prometheus-port", str(_free_port()),
             "--log-level", "info"],
            stdout=out, stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}/v1"
    try:
        deadline = time.monotonic() + 60
        async with httpx.AsyncClient(timeout=5) as client:
            while True:
                assert proc.poll() is None, f"smg exited:\n{log.read_text()[-3000:]}"
                try:
                    models = (await client.get(f"{base}/models")).json()
                    if [m["id"] for m in models.get("data", [])] == ["tiny"]:
                        break
                except httpx.HTTPError:
                    pass
                assert time.monotonic() < deadline, \
                    f"smg registered no worker:\n{log.read_text()[-3000:]}"
                await asyncio.sleep(0.5)
        yield base
    finally:
        proc.terminate()
        await asyncio.to_thread(proc.wait, 30)


def _chat(content: str, **extra) -> dict:
    return {"model": "tiny", "messages": [{"role": "user", "content": content}],
            "temperature": 0, "max_tokens": 16, "logprobs": True, **extra}


async def _post(url: str, body: dict) -> dict:
    async with httpx.AsyncClient(timeout=120) as client:
        reply = await client.post(f"{url}/chat/completions", json=body,
                                  headers={"authorization": f"Bearer {API_KEY}"})
    assert reply.status_code == 200, reply.text
    return reply.json()


def _tokens(answer: dict) -> list[tuple[str, float]]:
    return [(entry["token"], entry["logprob"])
            for entry in answer["choices"][0]["logprobs"]["content"]]


@pytest.mark.parametrize("content", [SHORT, LONG], ids=["colocated", "disaggregated"])
async def test_smg_answers_token_for_token_as_batons_own_front(server, smg, content):
    baton = await _post(f"http://127.0.0.1:{server.http_port}/v1", _chat(content))
    through_smg = await _post(smg, _chat(content))
    got, expected = _tokens(through_smg), _tokens(baton)
    assert [token for token, _ in got] == [token for token, _ in expected]
    assert [lp for _, lp in got] == pytest.approx([lp for _, lp in expected],
                                                  abs=LOGPROB_TOLERANCE)
    assert through_smg["choices"][0]["message"]["content"] == \
        baton["choices"][0]["message"]["content"]
    assert through_smg["choices"][0]["finish_reason"] == baton["choices"][0]["finish_reason"]
    for field in ("prompt_tokens", "completion_tokens"):
        assert through_smg["usage"][field] == baton["usage"][field]
    placement = baton["baton"]["placement"]
    assert (placement["prefill"] == placement["decode"]) == (content == SHORT)


async def test_n_choices_through_smg_are_batons_own_choices(server, smg):
    """SMG sends ``n`` in one request to its gRPC worker and collects the choices by their
    ``index``: each sampled choice (``seed + index``, vLLM's rule) is token for token the one
    Baton's own front answers with the same ``n`` and seed."""
    body = _chat(SHORT, temperature=1.0, seed=5, n=2)
    baton = await _post(f"http://127.0.0.1:{server.http_port}/v1", body)
    contract = server.fronts.engine_contract.servicer.counters
    before = contract.generated
    through_smg = await _post(smg, body)
    assert contract.generated == before + 1  # one Generate call carried both choices
    got = sorted(through_smg["choices"], key=lambda choice: choice["index"])
    expected = sorted(baton["choices"], key=lambda choice: choice["index"])
    assert [choice["index"] for choice in got] == [0, 1]
    for mine, theirs in zip(got, expected):
        assert [entry["token"] for entry in mine["logprobs"]["content"]] == \
            [entry["token"] for entry in theirs["logprobs"]["content"]]
        assert mine["message"]["content"] == theirs["message"]["content"]
    assert got[0]["message"]["content"] != got[1]["message"]["content"]  # two samples
    assert through_smg["usage"]["completion_tokens"] == baton["usage"]["completion_tokens"]


async def test_smg_streams(server, smg):
    baton = await _post(f"http://127.0.0.1:{server.http_port}/v1", _chat(SHORT, logprobs=False))
    deltas, finish = [], None
    async with httpx.AsyncClient(timeout=120) as client:
        async with client.stream("POST", f"{smg}/chat/completions",
                                 json=_chat(SHORT, logprobs=False, stream=True),
                                 headers={"authorization": f"Bearer {API_KEY}"}) as reply:
            assert reply.status_code == 200
            async for line in reply.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                choice = json.loads(line[6:])["choices"][0]
                if choice["delta"].get("content"):
                    deltas.append(choice["delta"]["content"])
                finish = choice["finish_reason"] or finish
    assert len(deltas) > 1
    assert "".join(deltas) == baton["choices"][0]["message"]["content"]
    assert finish == baton["choices"][0]["finish_reason"]


async def _wait_for(check, timeout_s: float, what: str):
    deadline = time.monotonic() + timeout_s
    while True:
        value = await check()
        if value:
            return value
        assert time.monotonic() < deadline, f"no {what} within {timeout_s} s"
        await asyncio.sleep(0.1)


async def test_a_client_going_away_aborts_the_request_inside_baton(server, smg):
    servicer = server.fronts.engine_contract.servicer
    cancels_before = server.router.call_counts().sent.get("decode.cancel", 0)
    aborted_before = servicer.counters.aborted_by_rpc
    num_deltas = 0
    async with grpc.aio.insecure_channel(
            f"127.0.0.1:{server.fronts.engine_contract.port}") as channel:
        stub = vpb_grpc.VllmEngineStub(channel)

        async def running() -> int:
            load = (await stub.GetLoads(vpb.GetLoadsRequest())).loads[0]
            return load.num_running_reqs

        async def nothing_running() -> bool:
            return await running() == 0

        # the engines' stats (GetLoads) lag the earlier tests' requests by a refresh: start once
        # they show none, so the one running below is this test's (a slow CI box saw 2)
        await _wait_for(nothing_running, 10, "idle cluster before the request")
        async with httpx.AsyncClient(timeout=120) as client:
            body = _chat(SHORT, logprobs=False, stream=True, max_tokens=6000, ignore_eos=True)
            async with client.stream("POST", f"{smg}/chat/completions", json=body,
                                     headers={"authorization": f"Bearer {API_KEY}"}) as reply:
                assert reply.status_code == 200
                num_running = 0
                async for line in reply.aiter_lines():  # reading on while the stats catch up
                    num_deltas += line.startswith("data: ")
                    if num_deltas % 5 == 0:
                        # GetLoads reports the request running in the cluster (worker stats)
                        num_running = await running()
                        if num_running:
                            break
                    assert num_deltas < 3000, "GetLoads never saw the request running"
                assert num_running == 1
        # the client is gone: SMG aborts, Baton cancels the decode and closes the books

        async def cancelled() -> bool:
            return server.router.call_counts().sent.get("decode.cancel", 0) > cancels_before

        await _wait_for(cancelled, 10, "decode cancel")
        # SMG sends Abort for the request its client left (it drops the stream too)
        assert servicer.counters.aborted_by_rpc == aborted_before + 1
        assert servicer.counters.aborted_ids[-1].startswith("chatcmpl-")

        async def idle() -> bool:
            status = await server.cluster.conductor.status.remote()
            return status.num_in_flight_decodes == 0 and await running() == 0

        await _wait_for(idle, 10, "idle cluster after the abort")


async def test_kv_events_of_the_engines_reach_a_subscriber(server, smg, tiny_model):
    prompt = PromptTokenizer(tiny_model.path).encode_chat([("user", UNSEEN)])
    async with grpc.aio.insecure_channel(
            f"127.0.0.1:{server.fronts.engine_contract.port}") as channel:
        stub = vpb_grpc.VllmEngineStub(channel)
        info = await stub.GetServerInfo(vpb.GetServerInfoRequest())
        assert info.block_size > 0 and len(prompt) >= info.block_size
        events = stub.SubscribeKvEvents(cpb.SubscribeKvEventsRequest())
        await events.initial_metadata()
        await _post(smg, _chat(UNSEEN, max_tokens=2))
        stored: list[list[int]] = []

        async def first_block() -> bool:
            batch = await asyncio.wait_for(events.read(), 10)
            stored.extend(list(block.token_ids) for event in batch.events
                          if event.WhichOneof("data") == "stored" for block in event.stored.blocks)
            return prompt[:info.block_size] in stored

        await _wait_for(first_block, 20, "stored block of the prompt")
        events.cancel()
        model = await stub.GetModelInfo(vpb.GetModelInfoRequest())
        assert (model.served_model_name, model.model_path) == ("tiny", str(tiny_model.path))


async def test_a_session_named_in_contract_metadata_reaches_the_conductor(server, tiny_model):
    """SMG's proto has no session field: a caller names its session in gRPC metadata, and the
    conductor's session table counts its steps as it does for the other fronts'."""
    prompt = PromptTokenizer(tiny_model.path).encode_chat([("user", LONG)])
    metadata = (("x-session-id", "contract-agent"), ("x-session-ttl-s", "60"))
    async with grpc.aio.insecure_channel(
            f"127.0.0.1:{server.fronts.engine_contract.port}") as channel:
        stub = vpb_grpc.VllmEngineStub(channel)
        for step in range(2):
            request = vpb.GenerateRequest(
                request_id=f"contract-session-{step}", stream=False,
                tokenized=vpb.TokenizedInput(input_ids=prompt + [7] * step),
                sampling_params=vpb.SamplingParams(temperature=0, max_tokens=2))
            answers = [r async for r in stub.Generate(request, metadata=metadata)]
            assert answers[-1].complete.finish_reason in ("length", "stop")
    view = await server.cluster.conductor.session.remote(
        scoped_session_id("", "", "contract-agent"))
    assert view is not None and view.num_steps == 2
    closed = await server.cluster.conductor.close_session.remote(
        scoped_session_id("", "", "contract-agent"))
    assert closed is not None and closed.num_steps == 2
