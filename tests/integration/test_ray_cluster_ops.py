"""Operating Baton on a multi-node Ray cluster: ``baton up``, ``scale``, ``drain``, ``status``,
``down`` as real subprocesses against a Ray cluster of three "nodes" on this machine (a head, a
prefill node advertising ``baton_prefill``, a decode node advertising ``baton_decode``), while
concurrent gRPC streams run (a status and a scale go through the gateway's Admin service with
``--endpoint`` and the admin key instead of Ray); then the metrics the Grafana dashboard uses,
scraped from the gateway actor's ``/metrics``."""

from __future__ import annotations

import asyncio
import json
import os
import re
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
import ray
import yaml
from ray.cluster_utils import Cluster

from gateway.client import GenerateFailed, generate

pytestmark = pytest.mark.engine

BATON = [sys.executable, "-m", "cli.main"]
REPO = Path(__file__).resolve().parents[2]
NAME, NAMESPACE = "opstest", "opstest"
ADMIN_KEY = "opstest-admin-key-5f1e"
SHARED_PREFIX = " ".join(f"agent step {i}: read the file, run the tests, fix the bug." for i in range(30))


@pytest.fixture(scope="module")
def ray_cluster():
    # the nodes' processes inherit it: store nodes admit only peers that know the secret
    os.environ.setdefault("BATON_TRANSFER_TOKEN", "ops-test-transfer-secret")
    cluster = Cluster(initialize_head=True, connect=False,
                      head_node_args={"num_cpus": 1, "include_dashboard": False})
    cluster.add_node(num_cpus=0, resources={"baton_prefill": 2})
    cluster.add_node(num_cpus=0, resources={"baton_decode": 2})
    cluster.wait_for_nodes()
    ray.init(address=cluster.address, namespace=NAMESPACE, log_to_driver=False)
    try:
        yield cluster
    finally:
        ray.shutdown()
        cluster.shutdown()


def _env(cluster) -> dict[str, str]:
    return {**os.environ, "RAY_ADDRESS": cluster.address, "PYTHONPATH": str(REPO)}


def _cli(cluster, *args: str, timeout_s: float = 240) -> subprocess.CompletedProcess:
    return subprocess.run([*BATON, *args], env=_env(cluster), cwd=REPO, capture_output=True,
                          text=True, timeout=timeout_s)


async def _acli(cluster, *args: str, timeout_s: float = 240) -> tuple[int, str, str]:
    proc = await asyncio.create_subprocess_exec(
        *BATON, *args, env=_env(cluster), cwd=REPO,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    out, err = await asyncio.wait_for(proc.communicate(), timeout_s)
    return proc.returncode, out.decode(), err.decode()


def _ops(*args: str) -> list[str]:
    return [*args, "--name", NAME, "--namespace", NAMESPACE]


async def _status(cluster) -> dict:
    rc, out, err = await _acli(cluster, *_ops("status", "--json"))
    assert rc == 0, err
    return json.loads(out)


def _ready_sizes(status: dict) -> dict[str, int]:
    return {pool: phases.get("ready", 0) for pool, phases in status["status"]["pool_sizes"].items()}


def _instances(status: dict, role: str) -> list[str]:
    return [r["instance_id"] for r in status["status"]["instances"] if r["role"] == role]


class Traffic:
    """``concurrency`` clients sending requests back to back until stopped."""

    def __init__(self, target: str, concurrency: int) -> None:
        self.target, self.concurrency = target, concurrency
        self.ok, self.failures = 0, []
        self._stop = asyncio.Event()
        self._tasks: list[asyncio.Task] = []

    async def _client(self, index: int) -> None:
        n = 0
        while not self._stop.is_set():
            try:
                result = await generate(self.target, text=f"{SHARED_PREFIX} client {index} turn {n}",
                                        max_tokens=16, timeout_s=120)
                assert result["finish_reason"] in ("length", "stop"), result["finish_reason"]
                self.ok += 1
            except (GenerateFailed, AssertionError) as exc:
                self.failures.append(repr(exc))
            n += 1

    def start(self) -> None:
        self._stop.clear()
        self._tasks = [asyncio.create_task(self._client(i)) for i in range(self.concurrency)]

    async def stop(self) -> None:
        self._stop.set()
        await asyncio.gather(*self._tasks)


def _admin(grpc_port: int, tmp_path: Path) -> list[str]:
    """Options that send an operator verb through the gateway's Admin service instead of Ray."""
    return ["--endpoint", f"127.0.0.1:{grpc_port}", "--admin-key-file", str(tmp_path / "admin.key")]


def _config(tmp_path: Path) -> Path:
    (tmp_path / "admin.key").write_text(f"{ADMIN_KEY}\n")
    path = tmp_path / "cluster.yaml"
    path.write_text(yaml.safe_dump({
        "name": NAME,
        "engine": {"model": "tiny", "omp_threads_bind": "nobind", "kv_cache_gib": 1.0},
        "prefill": {"num_instances": 1},
        "decode": {"num_instances": 1},
        # decode pulls each prompt's KV from the prefill node's store (no shm: not one machine)
        "kvstore": {"transfer": {"backend": "tcp", "same_node_shared_memory": False}},
        "conductor": {"tuning": {"short_prefill_tokens": 0}},  # every request disaggregated
        "gateway": {"port": 0, "admin_key_file": str(tmp_path / "admin.key")},
        "http": {"port": 0},
        "ray": {"namespace": NAMESPACE},
    }))
    return path


def _booked_decode() -> str:
    """The decode instance the conductor has something booked on (only one request runs)."""
    conductor = ray.get_actor(f"{NAME}-conductor", namespace=NAMESPACE)
    rows = ray.get(conductor.pool_status.remote()).instances
    booked = [r.instance_id for r in rows if r.role == "decode" and r.num_booked_reqs > 0]
    return booked[0] if len(booked) == 1 else ""


T0 = time.monotonic()


def _mark(what: str) -> None:
    print(f"[{time.monotonic() - T0:6.1f} s] {what}", flush=True)


async def test_up_scale_drain_status_metrics_down(ray_cluster, tmp_path):
    config = _config(tmp_path)
    _mark("start")
    bad = _cli(ray_cluster, "up", "--config", str(config), "--set", "conductor.policy=nope")
    assert bad.returncode == 2 and "unknown policy 'nope'" in bad.stderr

    up = _cli(ray_cluster, "up", "--config", str(config), "--timeout", "240")
    assert up.returncode == 0, up.stderr[-3000:]
    assert re.search(r"prefill: 0 -> 1; added opstest-prefill-0", up.stdout), up.stdout
    assert re.search(r"decode: 0 -> 1; added opstest-decode-0", up.stdout), up.stdout
    _mark("up done")
    grpc_port = int(re.search(r"gRPC\s+\S+:(\d+)", up.stdout).group(1))
    http_port = int(re.search(r"HTTP\s+http://\S+:(\d+)/v1", up.stdout).group(1))
    again = _cli(ray_cluster, "up", "--config", str(config))
    assert again.returncode == 0 and "already up; nothing changed" in again.stdout, again.stderr
    assert f":{grpc_port}" in again.stdout  # the same gateway

    status = await _status(ray_cluster)
    assert _ready_sizes(status) == {"prefill": 1, "decode": 1}
    nodes = {r["role"]: r["node_id"] for r in status["status"]["instances"]}
    assert nodes["prefill"] != nodes["decode"]  # each pool on its own Ray node, each with a store
    assert sorted(s["node_id"] for s in status["status"]["stores"]) == sorted(nodes.values())
    # the same status through the gateway's Admin service, without Ray
    rc, out, err = await _acli(ray_cluster, "status", "--json", *_admin(grpc_port, tmp_path))
    assert rc == 0, err
    remote = json.loads(out)
    assert remote["status"]["pool_sizes"] == status["status"]["pool_sizes"]
    assert [(r["instance_id"], r["node_id"], r["phase"]) for r in remote["status"]["instances"]] == \
        [(r["instance_id"], r["node_id"], r["phase"]) for r in status["status"]["instances"]]
    assert remote["fronts"] == status["fronts"] and remote["fronts"]["grpc_port"] == grpc_port

    _mark("status ok")
    # operators soft-pin the shared system prompt before traffic arrives
    rc, out, err = await _acli(ray_cluster, *_ops("pin", "system", "--text", SHARED_PREFIX))
    assert rc == 0, err
    pinned_blocks = int(re.search(r"pinned 'system': (\d+) blocks", out).group(1))
    assert pinned_blocks >= 1, out
    traffic = Traffic(f"127.0.0.1:{grpc_port}", concurrency=3)
    traffic.start()
    await asyncio.sleep(3)
    rc, out, err = await _acli(ray_cluster, *_ops("scale", "--prefill", "2", "--decode", "2"))
    assert rc == 0, err
    assert "prefill: 1 -> 2; added opstest-prefill-1" in out and "decode: 1 -> 2; added opstest-decode-1" in out
    status = await _status(ray_cluster)
    assert _ready_sizes(status) == {"prefill": 2, "decode": 2}
    await traffic.stop()
    _mark("scaled up")
    served_while_scaling_up = traffic.ok
    # every request was prefilled on the prefill node and decoded on the decode node: the decode
    # node's store pulled the prompts' blocks from the prefill node's, over the transfer engine
    stores = {s["node_id"]: s for s in (await _status(ray_cluster))["status"]["stores"]}
    assert stores[nodes["decode"]]["counters"]["pulled_blocks"] >= served_while_scaling_up
    assert stores[nodes["decode"]]["counters"]["pull_failures"] == 0
    assert stores[nodes["prefill"]]["counters"]["pulled_blocks"] == 0
    # the pinned prefix arrived after the pin and is held soft-pinned where it was stored
    assert stores[nodes["prefill"]]["counters"]["soft_pinned_blocks"] == pinned_blocks
    rc, out, err = await _acli(ray_cluster, *_ops("unpin", "nosuch"))
    assert rc == 4 and "no pinned prefix named 'nosuch'; pinned: system" in err

    # drain: one long stream in flight on a decode instance; it must finish before that goes
    long_request = asyncio.create_task(generate(f"127.0.0.1:{grpc_port}", text="a long answer",
                                                max_tokens=3000, timeout_s=240))
    victim = ""
    while not victim and not long_request.done():
        victim = _booked_decode()
        await asyncio.sleep(0.02)
    _mark("victim seen")
    assert victim, "the long request finished before it could be seen in flight"
    rc, out, err = await _acli(ray_cluster, *_ops("drain", victim))
    assert rc == 0, err
    _mark("drain done")
    drained = int(re.search(r"\((\d+) in-flight requests finished\)", out).group(1))
    assert drained == 1 and long_request.done()
    result = long_request.result()
    assert result["placement"]["decode"] == victim
    assert result["usage"]["completion_tokens"] == len(result["token_ids"]) > 0
    assert result["finish_reason"] in ("length", "stop")
    status = await _status(ray_cluster)
    assert victim not in _instances(status, "decode") and _ready_sizes(status)["decode"] == 1

    # prefill down and decode up at once, then decode down, with traffic flowing
    traffic.start()
    await asyncio.sleep(2)
    rc, out, err = await _acli(ray_cluster, *_ops("scale", "--prefill", "1", "--decode", "2"))
    assert rc == 0, err
    assert re.search(r"prefill: 2 -> 1; drained and removed opstest-prefill-\d", out), out
    # a new instance takes the next index after the highest one left (which one the drain took
    # depends on where the long request landed)
    next_decode = max(int(i.rsplit("-", 1)[1]) for i in _instances(status, "decode")) + 1
    assert f"decode: 1 -> 2; added opstest-decode-{next_decode}" in out, out
    _mark("scaled p1 d2")
    await asyncio.sleep(2)
    # this scale-down goes through the Admin service: the same drain, in the conductor
    rc, out, err = await _acli(ray_cluster, "scale", "--decode", "1", *_admin(grpc_port, tmp_path))
    assert rc == 0, err
    assert re.search(r"decode: 2 -> 1; drained and removed opstest-decode-\d", out), out
    await asyncio.sleep(1)
    _mark("scaled d1")
    await traffic.stop()
    assert traffic.failures == []
    assert served_while_scaling_up >= 4 and traffic.ok > served_while_scaling_up
    status = await _status(ray_cluster)
    assert _ready_sizes(status) == {"prefill": 1, "decode": 1}
    assert status["status"]["pool_sizes"] == {"prefill": {"ready": 1}, "decode": {"ready": 1}}
    assert status["status"]["counters"]["placed"] >= traffic.ok + 1
    assert any("scale decode 2 -> 1: operator request (Admin API from" in line
               for line in status["status"]["recent_events"])

    _mark("final status")
    # operator errors have their exit codes
    wrong_key = tmp_path / "wrong.key"
    wrong_key.write_text("not-the-admin-key\n")
    unknown, last, not_up, remote_last, bad_key = await asyncio.gather(
        _acli(ray_cluster, *_ops("drain", "opstest-decode-99")),
        _acli(ray_cluster, *_ops("drain", _instances(status, "decode")[0])),
        _acli(ray_cluster, "status", "--name", "nosuch", "--namespace", NAMESPACE),
        _acli(ray_cluster, "drain", _instances(status, "decode")[0], *_admin(grpc_port, tmp_path)),
        _acli(ray_cluster, "status", "--endpoint", f"127.0.0.1:{grpc_port}",
              "--admin-key-file", str(wrong_key)))
    assert unknown[0] == 4 and "no instance 'opstest-decode-99'" in unknown[2]
    assert last[0] == 5 and "last ready decode instance" in last[2]
    assert not_up[0] == 3 and "is not up" in not_up[2]
    assert remote_last[0] == 5 and "last ready decode instance" in remote_last[2]
    assert bad_key[0] == 2 and "refused the admin key" in bad_key[2]
    table = await _acli(ray_cluster, *_ops("status"))
    assert table[0] == 0 and "opstest-prefill-" in table[1] and "placements:" in table[1]

    _mark("errors checked")
    # the metrics the dashboard uses, from the gateway actor's /metrics
    scrape = urllib.request.urlopen(f"http://127.0.0.1:{http_port}/metrics", timeout=10).read().decode()
    check_dashboard_metrics(scrape)

    _mark("metrics checked")
    down = _cli(ray_cluster, *_ops("down"))
    assert down.returncode == 0 and "removed" in down.stdout, down.stderr
    left = [a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
            if a["name"].startswith(f"{NAME}-")]
    assert left == []
    again = _cli(ray_cluster, *_ops("down"))
    assert again.returncode == 0 and "was not up; nothing to remove" in again.stdout


def _sample(scrape: str, name: str, labels: str = "") -> float:
    pattern = rf"^{re.escape(name)}{re.escape(labels)}\s+([0-9.e+-]+)$" if labels else \
        rf"^{re.escape(name)}(?:\{{[^}}]*\}})?\s+([0-9.e+-]+)$"
    values = [float(m.group(1)) for m in re.finditer(pattern, scrape, re.M)]
    assert values, f"no sample {name}{labels} in the scrape"
    return sum(values)


def check_dashboard_metrics(scrape: str) -> None:
    from prometheus_client.parser import text_string_to_metric_families

    from tests.deploy_checks import dashboard_metric_names

    families = {f.name for f in text_string_to_metric_families(scrape)}
    for name in dashboard_metric_names():
        base = re.sub(r"_(bucket|sum|count|total)$", "", name)
        assert base in families, f"dashboard metric {name} not served"
    assert _sample(scrape, "baton_time_to_first_token_seconds_count") > 0
    assert _sample(scrape, "baton_inter_token_latency_seconds_count") > 0
    assert _sample(scrape, "baton_prefix_cache_queries_total") > 0
    assert _sample(scrape, "baton_prefix_cache_hits_total") > 0
    assert _sample(scrape, "baton_pool_instances", '{phase="ready",pool="prefill"}') == 1.0
    assert _sample(scrape, "baton_pool_instances", '{phase="ready",pool="decode"}') == 1.0
