"""Fuzzing the gRPC gateway: 10,000 generated requests, 0 crashes, 0 hangs, a defined status each.

The gateway (real gRPC server, real tokenizer, real validation) sits in front of a scripted
router, so what is fuzzed is everything between the socket and the router: parsing, validation,
tokenization, error mapping. Requests are raw bytes: well-formed messages with hostile values
(huge, empty, negative, NaN, unknown roles, invalid token ids), valid messages with bytes
flipped, inserted or cut, fields with the wrong wire type, strings that are not UTF-8, and
random bytes. Seeded, so a failure replays.
"""

from __future__ import annotations

import asyncio
import math
import random
import struct

import grpc
import pytest

from bench.fuzz_wire import field, varint
from engine.models import prepare_model
from gateway.inference import InferenceServicer, start_gateway
from gateway.tokenization import PromptTokenizer
from protos.baton.v1 import inference_pb2 as pb
from tests.unit.test_gateway_wire import FakeRouter

NUM_REQUESTS = 10_000
CONCURRENCY = 64
DEFINED = {grpc.StatusCode.OK, grpc.StatusCode.INVALID_ARGUMENT}
METHOD = "/baton.v1.Inference/Generate"


def _text(rng: random.Random) -> str:
    kind = rng.randrange(6)
    if kind == 0:
        return ""
    if kind == 1:
        return "x" * rng.choice([1, 100, 5_000, 200_000])
    if kind == 2:
        return "".join(chr(rng.randrange(0x20, 0x2FFF)) for _ in range(rng.randrange(1, 200)))
    if kind == 3:
        return "\x00" * rng.randrange(1, 50)
    if kind == 4:
        return rng.choice(["Hello", "tiny", "system", "user", "<|im_end|>", "\ud7ff", "🙂" * 40])
    return "".join(rng.choice("ab \n\t{}[]<>") for _ in range(rng.randrange(1, 300)))


def _float(rng: random.Random) -> float:
    return rng.choice([0.0, -1.0, 0.5, 1.0, 2.5, 1e30, -1e-30, math.inf, -math.inf, math.nan,
                       rng.uniform(-10, 10)])


def _message(rng: random.Random) -> bytes:
    """A well-formed GenerateRequest with hostile values."""
    request = pb.GenerateRequest()
    prompt = rng.randrange(4)
    if prompt == 0:
        request.text = _text(rng)
    elif prompt == 1:
        ids = [rng.choice([0, 1, 5, 99, 100, 50_000, -1, 2**31 - 1, -(2**31)])
               for _ in range(rng.choice([0, 1, 10, 150, 3_000]))]
        request.token_ids.ids.extend(ids)
    elif prompt == 2:
        for _ in range(rng.choice([0, 1, 3, 40])):
            request.chat.messages.add(role=rng.choice(["user", "assistant", "system", "tool", "",
                                                       "root", _text(rng)[:20]]), content=_text(rng))
    if rng.random() < 0.8:
        s = request.sampling
        if rng.random() < 0.7:
            s.max_tokens = rng.choice([0, 1, 4, -5, 50, 10**6, 2**31 - 1])
        s.temperature = _float(rng)
        if rng.random() < 0.5:
            s.top_p = _float(rng)
        if rng.random() < 0.3:
            s.seed = rng.choice([0, -1, 2**63 - 1, -(2**63)])
        s.stop.extend(_text(rng)[:rng.choice([0, 5, 5_000])] for _ in range(rng.choice([0, 1, 3, 300])))
    if rng.random() < 0.3:
        request.model = rng.choice(["tiny", "", "gpt-4", _text(rng)[:100]])
    if rng.random() < 0.3:
        request.cache_salt = _text(rng)[:rng.choice([0, 10, 10_000])]
    if rng.random() < 0.3:
        request.request_id = rng.choice(["", "r", "same", _text(rng)[:rng.choice([10, 5_000])]])
    return request.SerializeToString()


def _raw(rng: random.Random) -> bytes:
    """Bytes that are not a well-formed GenerateRequest in one way or another."""
    kind = rng.randrange(5)
    if kind == 0:  # flip, insert or cut bytes of a real message
        data = bytearray(_message(rng))
        for _ in range(rng.randrange(1, 6)):
            op = rng.randrange(3)
            if op == 0 and data:
                data[rng.randrange(len(data))] ^= 1 << rng.randrange(8)
            elif op == 1:
                data.insert(rng.randrange(len(data) + 1), rng.randrange(256))
            elif data:
                del data[rng.randrange(len(data)):]
        return bytes(data)
    if kind == 1:  # a string field that is not UTF-8
        number = rng.choice([1, 2, 6, 7])
        return field(number, 2, bytes(rng.randrange(0x80, 0x100) for _ in range(rng.randrange(1, 20))))
    if kind == 2:  # known fields with the wrong wire type
        number = rng.choice([1, 2, 3, 4, 5, 6, 7])
        wire_type = rng.choice([0, 1, 5])
        payload = {0: varint(rng.randrange(2**40)), 1: struct.pack("<d", 1.5), 5: struct.pack("<f", 2.0)}
        return field(number, wire_type, payload[wire_type])
    if kind == 3:  # unknown fields, deep nesting, huge declared lengths
        return rng.choice([
            field(99, 2, b"unknown") + field(2, 2, b"hi"),
            field(5, 2, field(1, 0, varint(2**64 - 1))),
            varint(2 << 3 | 2) + varint(2**31),
            field(4, 2, field(1, 2, field(1, 2, b"\xff\xfe"))),
        ])
    return bytes(rng.randrange(256) for _ in range(rng.choice([0, 1, 7, 64, 1000])))


async def _call(channel: grpc.aio.Channel, payload: bytes) -> tuple[grpc.StatusCode, bool]:
    """(status, whether an OK stream ended with a Final message)."""
    call = channel.unary_stream(METHOD, request_serializer=lambda b: b,
                                response_deserializer=pb.GenerateResponse.FromString)
    final = False
    try:
        async for response in call(payload, timeout=10):
            final = response.HasField("final")
        return grpc.StatusCode.OK, final
    except grpc.aio.AioRpcError as e:
        return e.code(), False


@pytest.mark.asyncio
async def test_ten_thousand_hostile_requests_get_a_defined_status_and_the_gateway_keeps_serving():
    router = FakeRouter()
    servicer = InferenceServicer(router, PromptTokenizer(prepare_model("tiny").path), "tiny", 100)
    gateway = await start_gateway(servicer, "127.0.0.1", 0)
    rng = random.Random(20261130)
    payloads = [(_message if rng.random() < 0.5 else _raw)(rng) for _ in range(NUM_REQUESTS)]
    statuses: dict[grpc.StatusCode, int] = {}
    undefined: list[tuple[bytes, grpc.StatusCode]] = []
    ok_without_final = 0
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{gateway.port}", options=[
                ("grpc.max_send_message_length", 64 << 20)]) as channel:
            for start in range(0, NUM_REQUESTS, CONCURRENCY):
                batch = payloads[start:start + CONCURRENCY]
                for payload, (status, final) in zip(batch, await asyncio.gather(
                        *(_call(channel, p) for p in batch))):
                    statuses[status] = statuses.get(status, 0) + 1
                    if status not in DEFINED:
                        undefined.append((payload[:200], status))
                    ok_without_final += status == grpc.StatusCode.OK and not final
            # ... and after all that, a plain request is served normally.
            status, final = await _call(channel, pb.GenerateRequest(text="hello").SerializeToString())
    finally:
        await gateway.stop(None)
    print(f"fuzz: {NUM_REQUESTS} requests, statuses {({k.name: v for k, v in statuses.items()})}")
    assert sum(statuses.values()) == NUM_REQUESTS
    assert undefined == [], f"{len(undefined)} undefined statuses; first: {undefined[:3]}"
    assert ok_without_final == 0
    assert statuses.get(grpc.StatusCode.OK, 0) > 100 and statuses[grpc.StatusCode.INVALID_ARGUMENT] > 1000
    assert (status, final) == (grpc.StatusCode.OK, True)
    assert router.num_closed_streams == len(router.requests)  # every stream the router opened closed
