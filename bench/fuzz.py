"""``baton bench fuzz``: structure-aware fuzz of both fronts through the router of a real cluster.

``bench.fuzz_cases`` makes the requests (valid ones, 1 to 3 seeded mutations each); this module
sends them (gRPC Generate, OpenAI chat and completions, Anthropic messages; ``concurrency`` at a
time), files every answer under the stage that ended it, then checks that a normal request on
each front is still served and that nothing leaked (``bench.leaks``).

The stage of an answer (``stage_of``, the one place it is decided):

========== ===================================================== ==============================
stage      gRPC                                                  HTTP (OpenAI / Anthropic)
========== ===================================================== ==============================
parse      INVALID_ARGUMENT, "the request is not a valid          400 whose message ends "... for
           baton.v1.GenerateRequest ..." (the bytes did not       the fields": malformed JSON or a
           parse: the gateway's tolerant parser)                 wrong type (the fronts'
                                                                 ``validation_message``)
validation any other INVALID_ARGUMENT (the front's checks)         any other 400, and 404 (unknown
                                                                 model)
admission  RESOURCE_EXHAUSTED with ``retry-after-ms``             429 (OpenAI) / 529 (Anthropic)
                                                                 with ``Retry-After``
engine     INVALID_ARGUMENT / 400 naming a request id "already in flight on this instance": an
           engine refused a duplicate id after placement; on HTTP also a 200 whose stream
           ends with one well-formed ``error`` event of type invalid_request_error (the stream
           opens once the request is placed, so only an engine can refuse it then)
served     OK, the stream ended with ``Final``                    200: the whole answer (``baton``
                                                                 fields present), or a stream
                                                                 ending ``[DONE]`` / message_stop
                                                                 with no ``error`` event
other      anything else: INTERNAL, UNKNOWN, UNAVAILABLE, 500, 503, 422, a broken stream, no answer
           within ``TIMEOUT_S``. Must be 0: UNAVAILABLE / 503 too, because on a healthy cluster
           it means a request took a worker down.
========== ===================================================== ==============================

"Past validation" is admission + engine + served; the cluster's own books cross-check it: the
conductor's placements during the run (``conductor.placed``) must equal served + engine, its
rejections (``conductor.rejected``) admission.
"""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path
from typing import Callable

import grpc
import httpx
import msgspec

from bench.fuzz_cases import FRONTS, FuzzCase, Limits, fuzz_cases
from bench.leaks import leaks
from cluster.config import ClusterConfig
from cluster.serve import BatonServer
from gateway import client
from protos.baton.v1 import inference_pb2 as pb

STAGES = ("parse", "validation", "admission", "engine", "served", "other")
PAST_VALIDATION = ("admission", "engine", "served")
GRPC_PARSE_PREFIX = f"the request is not a valid {pb.GenerateRequest.DESCRIPTOR.full_name}"
HTTP_PARSE_SUFFIX = "for the fields"
ENGINE_MARKER = "is already in flight on this instance"
ADMISSION_STATUS = {"chat": "429", "completions": "429", "messages": "529"}
HTTP_PATHS = {"chat": "/v1/chat/completions", "completions": "/v1/completions",
              "messages": "/v1/messages"}
METHOD = "/baton.v1.Inference/Generate"
TIMEOUT_S = 60.0
"""A case with no complete answer by then is ``other`` (a hang)."""
UNDEFINED_KEPT = 20


class Outcome(msgspec.Struct, frozen=True):
    """What the server answered one case: the status (a gRPC code's name, an HTTP status,
    "200 <type>" for a stream that ended with an error event of that type, TIMEOUT, or the HTTP
    client's exception's name), the error message, whether a success was a whole answer, and
    whether a refusal said when to retry."""

    status: str
    message: str = ""
    complete: bool = False
    retry_hint: bool = False


class FuzzReport(msgspec.Struct):
    seed: int
    requests: int
    stages: dict[str, int]
    by_front: dict[str, dict[str, int]]
    conductor: dict[str, int] = {}
    """Placements and admission rejections the conductor counted during the run."""
    normal_served: dict[str, bool] = {}
    """A normal request per front after the fuzz: served?"""
    leaks: dict[str, int] = {}
    undefined: list[dict] = []
    """The first cases filed under ``other``, with their payloads' first bytes; one case replays
    alone: ``bench.fuzz_cases.fuzz_case(seed, index, limits)``."""
    duration_s: float = 0.0

    @property
    def past_validation(self) -> int:
        return sum(self.stages[stage] for stage in PAST_VALIDATION)

    @property
    def books_agree(self) -> bool:
        """The conductor placed exactly the served and engine-refused cases and rejected exactly
        the admission ones (no refusal past placement was filed as the front's)."""
        return self.conductor == {"placed": self.stages["served"] + self.stages["engine"],
                                  "rejected": self.stages["admission"]}

    @property
    def ok(self) -> bool:
        return (self.stages["other"] == 0 and 2 * self.past_validation >= self.requests
                and self.books_agree and all(self.normal_served.values())
                and not any(self.leaks.values()))


def stage_of(front: str, outcome: Outcome) -> str:
    """The stage that ended a case (the table in the module docstring)."""
    rejected = "engine" if ENGINE_MARKER in outcome.message else "validation"
    if front == "grpc":
        if outcome.status == "OK":
            return "served" if outcome.complete else "other"
        if outcome.status == "INVALID_ARGUMENT":
            return "parse" if outcome.message.startswith(GRPC_PARSE_PREFIX) else rejected
        if outcome.status == "RESOURCE_EXHAUSTED" and outcome.retry_hint:
            return "admission"
        return "other"
    if outcome.status == "200":
        return "served" if outcome.complete else "other"
    if outcome.status == "200 invalid_request_error":  # after placement: the engine's
        return "engine"
    if outcome.status == "400":
        return "parse" if outcome.message.endswith(HTTP_PARSE_SUFFIX) else rejected
    if outcome.status == "404":
        return "validation"
    if outcome.status == ADMISSION_STATUS[front] and outcome.retry_hint:
        return "admission"
    return "other"


async def _send_grpc(channel: grpc.aio.Channel, case: FuzzCase) -> Outcome:
    call = channel.unary_stream(METHOD, request_serializer=lambda data: data,
                                response_deserializer=pb.GenerateResponse.FromString)
    finals = 0
    after_final = False
    try:
        async for response in call(case.payload, timeout=TIMEOUT_S):
            after_final |= finals > 0
            finals += response.HasField("final")
    except grpc.aio.AioRpcError as e:
        hint = any(key == "retry-after-ms" for key, _ in (e.trailing_metadata() or ()))
        return Outcome(e.code().name, e.details() or "", retry_hint=hint)
    return Outcome("OK", complete=finals == 1 and not after_final)


def _answer(front: str, content_type: str, body: bytes) -> tuple[bool, dict | None]:
    """Whether a 200's body is a whole answer (JSON with Baton's fields, or an SSE stream that
    ended as the front ends a good one), and the error event a stream ended with, if any."""
    text = body.decode(errors="replace")
    if not content_type.startswith("text/event-stream"):
        try:
            answer = json.loads(text)
        except ValueError:
            return False, None
        return isinstance(answer, dict) and "baton" in answer and "error" not in answer, None
    lines = text.splitlines()
    datas = [line[len("data: "):] for line in lines if line.startswith("data: ")]
    try:
        chunks = [json.loads(data) for data in datas if data != "[DONE]"]
    except ValueError:
        return False, None
    errors = [chunk["error"] for chunk in chunks if isinstance(chunk.get("error"), dict)]
    if front == "messages":
        events = [line[len("event: "):] for line in lines if line.startswith("event: ")]
        done = bool(events) and events[-1] in ("message_stop", "error")
        ended = bool(events) and events[-1] == "message_stop"
    else:
        done = ended = bool(datas) and datas[-1] == "[DONE]"
    if errors:
        return False, errors[-1] if done and len(errors) == 1 else None
    return ended and any("baton" in chunk for chunk in chunks), None


def _error_message(body: bytes) -> str:
    try:
        return str(json.loads(body)["error"]["message"])
    except (ValueError, KeyError, TypeError):
        return body[:300].decode(errors="replace")


async def _send_http(http: httpx.AsyncClient, case: FuzzCase) -> Outcome:
    try:
        async with http.stream("POST", HTTP_PATHS[case.front], content=case.payload,
                               headers=case.headers, timeout=TIMEOUT_S) as response:
            body = await response.aread()
    except httpx.HTTPError as e:
        return Outcome(type(e).__name__, str(e))
    hint = "retry-after" in response.headers
    if response.status_code != 200:
        return Outcome(str(response.status_code), _error_message(body), retry_hint=hint)
    complete, error = _answer(case.front, response.headers.get("content-type", ""), body)
    if error is not None:
        return Outcome(f"200 {error.get('type')}", str(error.get("message")))
    return Outcome("200", "" if complete else body[-300:].decode(errors="replace"), complete)


async def send_all(cases: list[FuzzCase], target: str, http_url: str, concurrency: int
                   ) -> list[Outcome]:
    """Every case's outcome, ``concurrency`` in flight at a time."""
    slots = asyncio.Semaphore(concurrency)
    options = [("grpc.max_send_message_length", 64 << 20)]
    async with (grpc.aio.insecure_channel(target, options=options) as channel,
                httpx.AsyncClient(base_url=http_url,
                                  limits=httpx.Limits(max_connections=concurrency)) as http):
        async def one(case: FuzzCase) -> Outcome:
            async with slots:
                send = _send_grpc(channel, case) if case.front == "grpc" else _send_http(http, case)
                try:
                    return await asyncio.wait_for(send, TIMEOUT_S + 10)
                except TimeoutError:
                    return Outcome("TIMEOUT", f"no answer within {TIMEOUT_S + 10:.0f} s")

        return await asyncio.gather(*(one(case) for case in cases))


def tally(seed: int, cases: list[FuzzCase], outcomes: list[Outcome]) -> FuzzReport:
    stages = dict.fromkeys(STAGES, 0)
    by_front = {front: dict.fromkeys(STAGES, 0) for front in FRONTS}
    undefined = []
    for case, outcome in zip(cases, outcomes):
        stage = stage_of(case.front, outcome)
        stages[stage] += 1
        by_front[case.front][stage] += 1
        if stage == "other" and len(undefined) < UNDEFINED_KEPT:
            undefined.append({"index": case.index, "front": case.front,
                              "mutations": list(case.mutations), "status": outcome.status,
                              "message": outcome.message[:500],
                              "payload": repr(case.payload[:400])})
    return FuzzReport(seed, len(cases), stages, by_front, undefined=undefined)


async def _normal_requests(server: BatonServer, http_url: str) -> dict[str, bool]:
    """One plain request per front, after the fuzz."""
    served = {}
    try:
        result = await client.generate(server.target, text="hello", max_tokens=4, timeout_s=60)
        served["grpc"] = result["finish_reason"] in ("stop", "length")
    except client.GenerateFailed:
        served["grpc"] = False
    bodies = {"chat": {"model": "", "messages": [{"role": "user", "content": "hello"}],
                       "max_tokens": 4},
              "messages": {"model": "", "max_tokens": 4,
                           "messages": [{"role": "user", "content": "hello"}]}}
    async with httpx.AsyncClient(base_url=http_url, timeout=60) as http:
        for front, body in bodies.items():
            response = await http.post(HTTP_PATHS[front], json=body)
            served[front] = response.status_code == 200 and "baton" in response.json()
    return served


def limits_of(server: BatonServer) -> Limits:
    model = server.cluster.model
    max_len = min(server.config.engine.max_model_len_tokens or model.max_model_len,
                  model.max_model_len)
    return Limits(server.fronts.tokenizer.vocab_size, max_len)


async def fuzz_server(server: BatonServer, num_requests: int, seed: int, concurrency: int = 12,
                      progress: Callable[[str], None] = lambda _m: None) -> FuzzReport:
    """Fuzz a started ``server`` (both fronts enabled), then the normal requests and the leaks."""
    started = time.monotonic()
    http_url = f"http://{server.config.http.host}:{server.http_port}"
    cases = fuzz_cases(seed, num_requests, limits_of(server))
    progress(f"seed {seed}: {num_requests} cases, {concurrency} at a time")
    before = (await server.cluster.conductor.status.remote()).counters
    outcomes = await send_all(cases, server.target, http_url, concurrency)
    after = (await server.cluster.conductor.status.remote()).counters
    report = tally(seed, cases, outcomes)
    report.conductor = {"placed": after.placed - before.placed,
                        "rejected": after.rejected - before.rejected}
    report.normal_served = await _normal_requests(server, http_url)
    report.leaks = await leaks(server)
    report.duration_s = round(time.monotonic() - started, 1)
    return report


def summary(report: FuzzReport) -> str:
    return (f"fuzz seed {report.seed}: {report.requests} requests, stages {report.stages} "
            f"(past validation {report.past_validation}); conductor {report.conductor}; "
            f"by front {report.by_front}; normal requests served {report.normal_served}; "
            f"leaks {report.leaks}; {report.duration_s} s")


def main(config: ClusterConfig, num_requests: int, seed: int, concurrency: int,
         json_path: Path | None, progress: Callable[[str], None]) -> FuzzReport:
    async def run() -> FuzzReport:
        server = BatonServer(config, progress=progress)
        await server.start()
        try:
            return await fuzz_server(server, num_requests, seed, concurrency, progress)
        finally:
            await server.stop()

    report = asyncio.run(run())
    print(summary(report))
    for case in report.undefined:
        print(f"undefined: {json.dumps(case)}")
    if json_path is not None:
        json_path.parent.mkdir(parents=True, exist_ok=True)
        json_path.write_text(json.dumps(msgspec.to_builtins(report), indent=2) + "\n")
    return report
