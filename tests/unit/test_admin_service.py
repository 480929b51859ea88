"""``baton.v1.Admin`` over real gRPC on loopback, in front of a real ``Conductor`` object.

The conductor is the class the Ray actor runs, called in-process through a stand-in for its
actor handle (``handle.method.remote(...)``), so Status, Scale, Drain, Pin and Unpin end in the
same conductor methods as ``baton status/scale/drain/pin/unpin`` through Ray. What needs Ray
itself (workers starting and leaving) is in ``tests/integration/test_ray_cluster_ops.py``.
"""

from __future__ import annotations

import json
import logging

import grpc
import msgspec
import pytest
import pytest_asyncio
from ray.exceptions import RayTaskError

from cli import admin_client
from cluster.control import ClusterConductor as Conductor
from cluster.deployment import NotUp
from cluster.pools import ScaleRefused
from conductor.config import ConductorConfig
from conductor.policy import PolicyConfig
from engine.models import prepare_model
from gateway.admin import ADMIN_OFF_MESSAGE, AdminServicer, _status_of
from gateway.admin_wire import StatusView, scale_from_pb, status_from_pb, status_to_pb
from gateway.auth import KeySet, read_admin_keys
from gateway.inference import InferenceServicer, start_gateway
from gateway.tokenization import PromptTokenizer
from protos.baton.v1 import admin_pb2 as apb
from protos.baton.v1 import admin_pb2_grpc as apb_grpc
from protos.baton.v1 import inference_pb2 as pb
from protos.errors import ConfigError
from protos.wire import FrontAddresses, Registration, ScaleResult
from tests.tls import self_signed
from tests.unit.test_gateway_wire import MAX_MODEL_LEN, SERVED, FakeRouter

ADMIN_KEY = "adm-5ecret-key-7f3c"
API_KEY = "inference-key-1"
FRONTS = FrontAddresses("10.0.0.7", 50051, 8000, True, "0.0.0.0", "127.0.0.1")
PREFIX_TEXT = " ".join(f"step {i}: read the file and fix the bug." for i in range(12))


class InProcessActor:
    """``handle.method.remote(*args)`` on a plain object, as on a Ray actor handle; records the
    methods called."""

    def __init__(self, target) -> None:
        self.target = target
        self.calls: list[str] = []

    def __getattr__(self, name: str):
        method, calls = getattr(self.target, name), self.calls

        class _Method:
            @staticmethod
            def remote(*args):
                calls.append(name)
                return method(*args)

        return _Method


@pytest.fixture(scope="module")
def tokenizer() -> PromptTokenizer:
    return PromptTokenizer(prepare_model("tiny").path)


@pytest_asyncio.fixture
async def conductor():
    # stats polling far away: the instances below are not Ray actors
    real = Conductor(ConductorConfig(stats_interval_s=3600), "admintest", PolicyConfig(), "127.0.0.1")
    for instance_id, role in (("t-prefill-0", "prefill"), ("t-decode-0", "decode")):
        await real.register(Registration(instance_id, role, "node-a", "tiny", "layout-1"))
        await real.mark_ready(instance_id)
    yield InProcessActor(real)
    for task in real._tasks:
        task.cancel()
    real._ctx.destroy(linger=0)


async def _gateway(conductor, tokenizer, admin_keys, tls=None):
    inference = InferenceServicer(FakeRouter(), tokenizer, SERVED, MAX_MODEL_LEN,
                                  api_keys=frozenset({API_KEY}))
    admin = AdminServicer(conductor, tokenizer, admin_keys, "admintest", fronts=lambda: FRONTS)
    return await start_gateway(inference, "127.0.0.1", 0, tls=tls, admin=admin)


@pytest_asyncio.fixture
async def gateway(conductor, tokenizer):
    running = await _gateway(conductor, tokenizer, KeySet({ADMIN_KEY}))
    yield running
    await running.stop(None)


@pytest_asyncio.fixture
async def stub(gateway):
    async with grpc.aio.insecure_channel(f"127.0.0.1:{gateway.port}") as channel:
        yield apb_grpc.AdminStub(channel)


def _auth(key: str = ADMIN_KEY) -> tuple[tuple[str, str], ...]:
    return (("authorization", f"Bearer {key}"),)


EVERY_RPC = {
    "Status": apb.StatusRequest(),
    "Scale": apb.ScaleRequest(decode=3),
    "Drain": apb.DrainRequest(instance_id="t-decode-0"),
    "Pin": apb.PinRequest(name="system", text=PREFIX_TEXT),
    "Unpin": apb.UnpinRequest(name="system"),
    "SetAutoscale": apb.SetAutoscaleRequest(enabled=False),
}
BAD_CREDENTIALS = {
    "no key": None,
    "wrong key": _auth("adm-5ecret-key-7f3d"),
    "the inference key": _auth(API_KEY),
    "no Bearer scheme": (("authorization", ADMIN_KEY),),
    "empty key": _auth(""),
}


async def _error(call) -> grpc.aio.AioRpcError:
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await call
    return info.value


@pytest.mark.parametrize("metadata", BAD_CREDENTIALS.values(), ids=BAD_CREDENTIALS.keys())
async def test_every_rpc_needs_the_admin_key(stub, conductor, metadata):
    for rpc, request in EVERY_RPC.items():
        error = await _error(getattr(stub, rpc)(request, timeout=5, metadata=metadata))
        assert error.code() == grpc.StatusCode.UNAUTHENTICATED, rpc
        assert error.details() == ("missing or invalid admin key: send metadata 'authorization: "
                                   "Bearer <admin key>' (an inference API key does not grant admin)")
    assert conductor.calls == []  # nothing reached the conductor


async def test_no_admin_key_configured_refuses_the_whole_service(conductor, tokenizer):
    running = await _gateway(conductor, tokenizer, KeySet())
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{running.port}") as channel:
            stub = apb_grpc.AdminStub(channel)
            for metadata in (None, _auth(), _auth(API_KEY)):
                for rpc, request in EVERY_RPC.items():
                    error = await _error(getattr(stub, rpc)(request, timeout=5, metadata=metadata))
                    assert error.code() == grpc.StatusCode.PERMISSION_DENIED, rpc
                    assert error.details() == ADMIN_OFF_MESSAGE
            assert "gateway.admin_key_file" in ADMIN_OFF_MESSAGE and "$BATON_ADMIN_KEY" in ADMIN_OFF_MESSAGE
    finally:
        await running.stop(None)
    assert conductor.calls == []


async def test_status_is_the_conductors_pool_status(stub, conductor):
    reply = await stub.Status(apb.StatusRequest(), timeout=5, metadata=_auth())

    pools = await conductor.target.pool_status()
    assert reply == status_to_pb(StatusView(pools, FRONTS, "admintest"))
    assert status_from_pb(reply) == StatusView(pools, FRONTS, "admintest")
    assert dict(reply.pool_sizes["prefill"].instances_by_phase) == {"ready": 1}
    assert dict(reply.pool_sizes["decode"].instances_by_phase) == {"ready": 1}
    assert [(i.instance_id, i.role, i.node_id, i.phase) for i in reply.instances] == [
        ("t-decode-0", "decode", "node-a", "ready"), ("t-prefill-0", "prefill", "node-a", "ready")]
    assert not reply.instances[0].HasField("recent_ttft_ms")  # no stats yet: unset, not 0
    assert reply.placement_counters["placed"] == 0 and reply.fronts.http_tls
    assert conductor.calls == ["pool_status"]


def test_status_round_trips_every_field():
    from conductor.state import PlacementCounters
    from protos.wire import CostModelStatus, InstanceRow, PoolStatus, PredictionError, StoreRow, TierCounters

    pools = PoolStatus(
        "baton", {"prefill": {"ready": 2, "draining": 1}, "decode": {}},
        [InstanceRow("c-prefill-0", "prefill", "n1", "ready", 3, 4, 5, 0.25, 1000, 640, 12.5, None,
                     1.5)],
        [StoreRow("n1", 100, 40, 6, 7, 8, TierCounters(1, 2, 3, 4, 9, 5, 1, disk_blocks=7)),
         StoreRow("n2", 100, 0, 0, 0, 0, TierCounters(0, 0, 0, 0, 0, 0, 0))],
        PlacementCounters(placed=10, rejected=1, coalesced=2, colocated=3, pulled=4,
                          index_corrections=5, by_prefill_instance={"c-prefill-0": 10}),
        ["12:00:00 scale prefill 1 -> 2"])
    for fronts in (None, FrontAddresses("h", None, 8000, False)):
        view = StatusView(pools, fronts, "c")
        assert status_from_pb(status_to_pb(view)) == view
    for cost_model in (CostModelStatus(False), CostModelStatus(True, PredictionError(7.5, 21.25, 40)),
                       CostModelStatus(True, PredictionError(1.0, 2.0, 3), PredictionError(4.0, 5.0, 6)),
                       CostModelStatus(True, None, None, "profile", 283.5, PredictionError(9.0, 30.5, 17)),
                       CostModelStatus(True, None, None, "", 0.0, None, PredictionError(3.5, 9.25, 60),
                                       PredictionError(14.5, 22.0, 36), PredictionError(6.0, 13.5, 44))):
        view = StatusView(msgspec.structs.replace(pools, cost_model=cost_model), None, "c")
        assert status_from_pb(status_to_pb(view)) == view
    # the proto's counters map holds what the node reported: no disk counters without a disk
    stores = status_to_pb(StatusView(pools, None, "c")).stores
    assert dict(stores[0].counters) == {
        "promoted_blocks": 1, "demoted_blocks": 2, "host_full_rejected_blocks": 3,
        "soft_pinned_blocks": 4, "pulled_blocks": 9, "pulled_bytes": 5, "pull_failures": 1,
        "disk_blocks": 7}
    assert sorted(stores[1].counters) == [
        "demoted_blocks", "host_full_rejected_blocks", "promoted_blocks", "pull_failures",
        "pulled_blocks", "pulled_bytes", "soft_pinned_blocks"]


async def test_scale_goes_through_the_conductors_pool_manager(stub, conductor):
    # the real PoolManager refuses: this conductor was not started by `baton up`
    error = await _error(stub.Scale(apb.ScaleRequest(prefill=2), timeout=5, metadata=_auth()))
    assert error.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert error.details().startswith("this cluster was not started with `baton up`")

    seen = []

    async def scale(role, size, timeout_s, reason):
        seen.append((role, size, timeout_s, reason))
        return ScaleResult(role, 1, size, [f"t-{role}-1"], [], [f"t-{role}-1"], [])

    conductor.target.pools.scale = scale
    reply = await stub.Scale(apb.ScaleRequest(prefill=2, decode=2, timeout_s=30), timeout=5,
                             metadata=_auth())
    assert scale_from_pb(reply) == [
        ScaleResult("prefill", 1, 2, ["t-prefill-1"], [], ["t-prefill-1"], []),
        ScaleResult("decode", 1, 2, ["t-decode-1"], [], ["t-decode-1"], [])]
    assert [s[:3] for s in seen] == [("prefill", 2, 30.0), ("decode", 2, 30.0)]
    assert seen[0][3].startswith("operator request (Admin API from ipv4:127.0.0.1:")
    error = await _error(stub.Scale(apb.ScaleRequest(), timeout=5, metadata=_auth()))
    assert (error.code(), error.details()) == (grpc.StatusCode.INVALID_ARGUMENT,
                                               "set prefill and/or decode")


async def test_drain_of_an_unknown_instance_is_not_found(stub, conductor):
    error = await _error(stub.Drain(apb.DrainRequest(instance_id="t-decode-9"), timeout=5,
                                    metadata=_auth()))
    assert error.code() == grpc.StatusCode.NOT_FOUND
    assert error.details().startswith("no instance 't-decode-9' in this cluster")
    assert conductor.calls == ["drain"]


async def test_pin_text_and_token_ids_then_unpin(stub, conductor, tokenizer):
    block_size = conductor.target.state.config.block_size_tokens
    token_ids = tokenizer.encode_text(PREFIX_TEXT)
    assert len(token_ids) >= 2 * block_size

    pinned = await stub.Pin(apb.PinRequest(name="system", text=PREFIX_TEXT), timeout=5,
                            metadata=_auth())
    assert (pinned.name, pinned.num_tokens, pinned.num_blocks) == (
        "system", len(token_ids), len(token_ids) // block_size)
    same = await stub.Pin(apb.PinRequest(name="ids", token_ids=pb.TokenIds(ids=token_ids)),
                          timeout=5, metadata=_auth())
    assert (same.num_tokens, same.num_blocks) == (pinned.num_tokens, pinned.num_blocks)
    salted = await stub.Pin(apb.PinRequest(name="tenant", text=PREFIX_TEXT, cache_salt="a"),
                            timeout=5, metadata=_auth())
    assert sorted(conductor.target._soft_pins) == ["ids", "system", "tenant"]
    assert conductor.target._soft_pins["ids"] == conductor.target._soft_pins["system"]
    assert conductor.target._soft_pins["tenant"] != conductor.target._soft_pins["system"]
    assert salted.num_blocks == pinned.num_blocks

    unpinned = await stub.Unpin(apb.UnpinRequest(name="system"), timeout=5, metadata=_auth())
    assert (unpinned.name, unpinned.num_blocks) == ("system", pinned.num_blocks)
    error = await _error(stub.Unpin(apb.UnpinRequest(name="system"), timeout=5, metadata=_auth()))
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert error.details() == "no pinned prefix named 'system'; pinned: ids, tenant"
    error = await _error(stub.Pin(apb.PinRequest(name="x"), timeout=5, metadata=_auth()))
    assert (error.code(), error.details()) == (grpc.StatusCode.INVALID_ARGUMENT,
                                               "give the prefix as text or token_ids")


def test_a_ray_task_error_keeps_its_causes_status_and_message():
    wrapped = RayTaskError("scale", "Traceback ...", ScaleRefused("a pool needs at least one instance"))
    assert _status_of(wrapped, "scale") == (grpc.StatusCode.FAILED_PRECONDITION,
                                            "a pool needs at least one instance")
    status, message = _status_of(ValueError("boom"), "scale")
    assert status == grpc.StatusCode.INTERNAL and "boom" not in message


async def test_the_admin_key_is_never_logged_or_shown(conductor, tokenizer, caplog, tmp_path):
    caplog.set_level(logging.DEBUG)
    running = await _gateway(conductor, tokenizer, KeySet({ADMIN_KEY}))
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{running.port}") as channel:
            stub = apb_grpc.AdminStub(channel)
            await stub.Status(apb.StatusRequest(), timeout=5, metadata=_auth())
            await _error(stub.Status(apb.StatusRequest(), timeout=5, metadata=_auth(ADMIN_KEY + "x")))
            await _error(stub.Drain(apb.DrainRequest(instance_id="nope"), timeout=5, metadata=_auth()))
    finally:
        await running.stop(None)
    shared = tmp_path / "keys"
    shared.write_text(f"{ADMIN_KEY}\n")
    with pytest.raises(ConfigError) as info:
        read_admin_keys(str(shared), KeySet({ADMIN_KEY}))

    assert "admin Status from ipv4:127.0.0.1:" in caplog.text  # calls are audited ...
    assert "refused: missing or invalid admin key" in caplog.text
    shown = [caplog.text, str(info.value), repr(KeySet({ADMIN_KEY})), str(KeySet({ADMIN_KEY})),
             repr(vars(AdminServicer(conductor, tokenizer, {ADMIN_KEY}, "c"))),
             repr(admin_client.AdminClient("h:1", ADMIN_KEY))]
    for text in shown:
        assert ADMIN_KEY not in text and "5ecret" not in text  # ... never with the key


def test_admin_keys_come_from_the_file_or_the_environment(tmp_path):
    keys = tmp_path / "admin"
    keys.write_text("# operators\nadm-one\n\n  adm-two  \n")
    assert read_admin_keys(str(keys), environ={"BATON_ADMIN_KEY": "adm-env"}) == {"adm-one", "adm-two"}
    assert read_admin_keys(None, environ={"BATON_ADMIN_KEY": " adm-env \n"}) == {"adm-env"}
    assert read_admin_keys(None, environ={"BATON_ADMIN_KEY": ""}) == frozenset()
    assert read_admin_keys(None, environ={}) == frozenset()
    with pytest.raises(ConfigError, match=r"^gateway.admin_key_file: cannot read .*missing"):
        read_admin_keys(str(tmp_path / "missing"), environ={})
    (tmp_path / "empty").write_text("# none yet\n")
    with pytest.raises(ConfigError, match="^gateway.admin_key_file: .*holds no key"):
        read_admin_keys(str(tmp_path / "empty"), environ={})
    with pytest.raises(ConfigError, match=r"^\$BATON_ADMIN_KEY holds a key that auth.api_key_file "
                                          "also accepts"):
        read_admin_keys(None, {"api-1", "adm-env"}, environ={"BATON_ADMIN_KEY": "adm-env"})


def test_a_key_set_accepts_exactly_its_keys():
    keys = KeySet({"k-one", "k-two"})
    assert keys.accepts("k-one") and keys.accepts("k-two")
    for offered in ("", "k-on", "k-one ", "K-ONE", "k-three"):
        assert not keys.accepts(offered)
    assert not KeySet().accepts("")


async def test_admin_over_tls(conductor, tokenizer, tmp_path):
    cert, key = self_signed(tmp_path, "gateway")
    running = await _gateway(conductor, tokenizer, KeySet({ADMIN_KEY}),
                             tls=(key.read_bytes(), cert.read_bytes()))
    endpoint = f"127.0.0.1:{running.port}"
    try:
        client = admin_client.AdminClient(endpoint, ADMIN_KEY, str(cert), connect_timeout_s=5)
        view = await _in_thread(client.status)
        assert view.cluster_name == "admintest" and len(view.pools.instances) == 2
        plaintext = admin_client.AdminClient(endpoint, ADMIN_KEY, connect_timeout_s=1)
        with pytest.raises(NotUp, match="if it serves TLS, pass --tls-ca"):
            await _in_thread(plaintext.status)
    finally:
        await running.stop(None)


async def _in_thread(function, *args):
    """The client (and the CLI) run their own event loop, as a separate process would."""
    import asyncio

    return await asyncio.to_thread(function, *args)


# ------------------------------------------------------------------- the CLI with --endpoint


async def _baton(*args: str, env: dict[str, str] | None = None):
    from typer.testing import CliRunner

    from cli.main import app

    return await _in_thread(lambda: CliRunner().invoke(app, list(args), env=env or {}))


async def test_cli_operates_through_the_admin_service(gateway, conductor, tmp_path, monkeypatch):
    monkeypatch.setattr(admin_client, "CONNECT_TIMEOUT_S", 2.0)
    endpoint = ["--endpoint", f"127.0.0.1:{gateway.port}"]
    key_file = tmp_path / "admin.key"
    key_file.write_text(f"# ops\n{ADMIN_KEY}\n")
    with_key = [*endpoint, "--admin-key-file", str(key_file)]
    no_ray = {"RAY_ADDRESS": ""}  # with --endpoint, Ray is never asked

    result = await _baton("status", "--json", *with_key, env=no_ray)
    assert result.exit_code == 0, result.output
    shown = json.loads(result.stdout)
    assert [r["instance_id"] for r in shown["status"]["instances"]] == ["t-decode-0", "t-prefill-0"]
    assert shown["fronts"] == {"host_ip": "10.0.0.7", "grpc_port": 50051, "http_port": 8000,
                               "http_tls": True, "grpc_host": "0.0.0.0", "http_host": "127.0.0.1"}
    table = await _baton("status", *endpoint, env={"BATON_ADMIN_KEY": ADMIN_KEY, **no_ray})
    assert table.exit_code == 0 and "Baton 'admintest'" in table.stdout, table.output
    assert "HTTP  https://127.0.0.1:8000/v1" in table.stdout  # HTTPS, at the bound address

    pinned = await _baton("pin", "system", "--text", PREFIX_TEXT, *with_key)
    assert pinned.exit_code == 0, pinned.output
    assert pinned.stdout.startswith("pinned 'system': ")
    unpinned = await _baton("unpin", "system", *with_key)
    assert unpinned.exit_code == 0 and unpinned.stdout.startswith("unpinned 'system'")

    # the exit codes of the Ray path: 4 unknown name, 5 refused, 2 bad key or none, 3 unreachable
    codes = {
        "unknown instance": (await _baton("drain", "t-decode-9", *with_key), 4),
        "unknown pin": (await _baton("unpin", "nosuch", *with_key), 4),
        "refused scale": (await _baton("scale", "--prefill", "2", *with_key), 5),
        "wrong key": (await _baton("status", *endpoint, env={"BATON_ADMIN_KEY": API_KEY}), 2),
        "no key": (await _baton("status", *endpoint), 2),
        "unreachable": (await _baton("status", "--endpoint", "127.0.0.1:1", *with_key[2:]), 3),
    }
    for what, (result, code) in codes.items():
        assert result.exit_code == code, (what, result.output)
    assert "refused the admin key" in codes["wrong key"][0].stderr
    assert codes["refused scale"][0].stderr.startswith(
        "error: this cluster was not started with `baton up`")
    assert "no instance 't-decode-9' in this cluster" in codes["unknown instance"][0].stderr
    assert API_KEY not in codes["wrong key"][0].output
    assert "no admin key: pass --admin-key-file FILE or set $BATON_ADMIN_KEY" in codes["no key"][0].stderr
    assert "no Baton gateway answers at 127.0.0.1:1" in codes["unreachable"][0].stderr


async def test_set_autoscale_turns_the_planner_off_and_on_without_ray(stub, conductor):
    from conductor.planner import PlannerConfig
    from gateway.admin_wire import autoscale_from_pb

    error = await _error(stub.SetAutoscale(apb.SetAutoscaleRequest(enabled=False), timeout=5,
                                           metadata=_auth()))
    assert error.code() == grpc.StatusCode.FAILED_PRECONDITION  # no planner: `baton serve`
    assert error.details().startswith("this cluster runs no autoscaling planner")
    await conductor.target.start_autoscaler(PlannerConfig(enabled=True, interval_s=3600))
    try:
        reply = await stub.SetAutoscale(apb.SetAutoscaleRequest(enabled=False), timeout=5,
                                        metadata=_auth())
        assert autoscale_from_pb(reply).enabled is False
        assert conductor.target.autoscaler.config.enabled is False
        status = status_from_pb(await stub.Status(apb.StatusRequest(), timeout=5,
                                                  metadata=_auth()))
        assert status.pools.autoscale.enabled is False and status.pools.autoscale.last == []
        reply = await stub.SetAutoscale(apb.SetAutoscaleRequest(enabled=True), timeout=5,
                                        metadata=_auth())
        assert reply.enabled and conductor.target.autoscaler.config.enabled
    finally:
        conductor.target.autoscaler.stop()


class _SessionsRouter(FakeRouter):
    """The fronts' router as far as closing a session goes: it asks the conductor."""

    def __init__(self, conductor) -> None:
        super().__init__()
        self._conductor = conductor

    async def close_session(self, session_id: str):
        return await self._conductor.close_session.remote(session_id)


async def test_cli_close_session_ends_a_live_session_through_the_admin_service(
        conductor, tokenizer, tmp_path, monkeypatch):
    from gateway.sessions import scoped_session_id
    from protos.wire import PlacementRequest

    monkeypatch.setattr(admin_client, "CONNECT_TIMEOUT_S", 2.0)
    scoped = scoped_session_id("sk-agent", "acme", "agent-1")
    for step in ("a", "b"):  # two steps of the session, placed by the real conductor state
        conductor.target.state.place(PlacementRequest(step, 10, (), 4, session_id=scoped))
        conductor.target.state.finished(step)
    inference = InferenceServicer(FakeRouter(), tokenizer, SERVED, MAX_MODEL_LEN)
    admin = AdminServicer(conductor, tokenizer, KeySet({ADMIN_KEY}), "admintest",
                          fronts=lambda: FRONTS, router=_SessionsRouter(conductor))
    running = await start_gateway(inference, "127.0.0.1", 0, admin=admin)
    try:
        with_key = ["--endpoint", f"127.0.0.1:{running.port}"]
        env = {"BATON_ADMIN_KEY": ADMIN_KEY, "RAY_ADDRESS": ""}
        wrong_key = await _baton("close-session", "agent-1", "--tenant", "acme",
                                 "--api-key", "sk-other", *with_key, env=env)
        closed = await _baton("close-session", "agent-1", "--tenant", "acme",
                              "--api-key", "sk-agent", *with_key, env=env)
        again = await _baton("close-session", "agent-1", "--tenant", "acme",
                             "--api-key", "sk-agent", *with_key, env=env)
    finally:
        await running.stop(None)
    assert wrong_key.exit_code == 4, wrong_key.output  # another key names another session
    assert closed.exit_code == 0, closed.output
    assert closed.stdout.strip() == ("closed session 'agent-1' after 2 steps; "
                                     "0 leased blocks released")  # no store node here
    assert again.exit_code == 4 and "no live session 'agent-1'" in again.stderr
    assert scoped not in conductor.target.state.sessions


def test_the_cost_models_error_reaches_its_gauges():
    from conductor.state import PlacementCounters
    from gateway import metrics
    from protos.wire import CostModelStatus, PoolStatus, PredictionError

    status = PoolStatus("baton", {}, [], [], PlacementCounters(), [],
                        cost_model=CostModelStatus(True, PredictionError(6.5, 19.0, 12)))
    metrics.set_pool_gauges(status)
    assert metrics.COST_MODEL_ERROR.labels("prefill", "median")._value.get() == 6.5
    assert metrics.COST_MODEL_ERROR.labels("prefill", "p90")._value.get() == 19.0
    handoff = CostModelStatus(True, None, None, "", 212.5, PredictionError(11.0, 35.5, 20))
    metrics.set_pool_gauges(msgspec.structs.replace(status, cost_model=handoff))
    assert metrics.HANDOFF_OVERHEAD._value.get() == 212.5
    assert metrics.COST_MODEL_ERROR.labels("handoff", "p90")._value.get() == 35.5
