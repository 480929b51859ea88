"""deploy/ says what the code does: the cluster YAML, the KubeRay manifest, the Prometheus
config, the Grafana dashboard and every command in the runbooks parse and name real entry
points, resources, ports and metrics."""

from __future__ import annotations

import json
import re
import shlex
from pathlib import Path

import prometheus_client
import pytest
import typer
import yaml

import gateway.metrics as metrics
from cli.main import app
from cluster.config import ClusterConfig, load_config
from cluster.pools import DECODE_RESOURCE, PREFILL_RESOURCE
from tests.deploy_checks import dashboard_metric_names

REPO = Path(__file__).resolve().parents[2]
DEPLOY = REPO / "deploy"
CLI = typer.main.get_command(app)


def _resolve(argv: list[str]):
    """Parse ``baton <argv>`` exactly as the CLI would (typer's own click), without running it;
    returns the command's context, whose ``params`` hold the parsed options."""
    assert argv, "empty command"
    command, name = CLI, "baton"
    while hasattr(command, "get_command"):  # a group: descend into the subcommand
        sub = command.get_command(command.make_context(name, [argv[0]], resilient_parsing=True),
                                  argv[0])
        assert sub is not None, f"no command '{name} {argv[0]}'"
        name, argv, command = argv[0], argv[1:], sub
    assert command.name == name
    return command.make_context(name, list(argv))


def _baton_commands(text: str) -> list[list[str]]:
    commands = []
    for block in re.findall(r"```bash\n(.*?)```", text, re.S):
        for line in block.splitlines():
            line = line.split("  #")[0].strip()
            words = shlex.split(line) if line else []
            if ".venv/bin/baton" in line or (words and words[0] == "baton"):
                start = next(i for i, w in enumerate(words) if w.endswith("baton"))
                commands.append(words[start + 1:])
    return commands


def test_ray_up_cluster_yaml_has_a_head_and_a_group_per_pool():
    cluster = yaml.safe_load((DEPLOY / "ray" / "cluster.yaml").read_text())
    types = cluster["available_node_types"]
    assert cluster["head_node_type"] in types
    pools = {name: spec for name, spec in types.items() if name != cluster["head_node_type"]}
    by_resource = {r: name for name, spec in pools.items() for r in spec["resources"]
                   if r.startswith("baton_")}
    assert set(by_resource) == {PREFILL_RESOURCE, DECODE_RESOURCE}
    for name, spec in pools.items():
        assert spec["resources"]["GPU"] >= 1 and spec["min_workers"] <= spec["max_workers"]
        # one pool slot per GPU: one instance per GPU
        pool_slots = [v for r, v in spec["resources"].items() if r.startswith("baton_")]
        assert pool_slots == [spec["resources"]["GPU"]]
    assert any("scripts/setup.sh --gpu" in c for c in cluster["setup_commands"])
    assert (REPO / "scripts" / "setup.sh").exists()
    assert all("ray start" in " ".join(cluster[k]) for k in ("head_start_ray_commands",
                                                             "worker_start_ray_commands"))
    # the commands in its header comment are the CLI's, and the config they name is valid
    header = "\n".join(l[1:].strip() for l in (DEPLOY / "ray" / "cluster.yaml").read_text().splitlines()
                       if l.startswith("#"))
    for quoted in re.findall(r'"cd baton && \.venv/bin/baton ([^"]+)"', header):
        _resolve(shlex.split(quoted))
    cfg = load_config(DEPLOY / "ray" / "baton.yaml")
    assert cfg.engine.device == "cuda" and cfg.gateway.host == "0.0.0.0"


def _kuberay_docs() -> dict[str, dict]:
    docs = [d for d in yaml.safe_load_all((DEPLOY / "kuberay" / "baton.yaml").read_text()) if d]
    return {d["kind"]: d for d in docs}


def test_kuberay_manifest_runs_baton_up_with_separate_pool_groups():
    docs = _kuberay_docs()
    job = docs["RayJob"]
    assert job["apiVersion"] == "ray.io/v1" and job["spec"]["shutdownAfterJobFinishes"] is False
    entry = shlex.split(job["spec"]["entrypoint"])
    assert entry[0] == "baton" and entry[1] == "up"
    ctx = _resolve(entry[1:])
    assert ctx.params["address"] == "auto"
    config_map = docs["ConfigMap"]
    config_path = Path(ctx.params["config"])
    cfg = ClusterConfig.model_validate(yaml.safe_load(config_map["data"][config_path.name]))
    head = job["spec"]["rayClusterSpec"]["headGroupSpec"]["template"]["spec"]
    mounts = head["containers"][0]["volumeMounts"]
    assert any(str(config_path.parent) == m["mountPath"] for m in mounts)
    groups = {g["groupName"]: g for g in job["spec"]["rayClusterSpec"]["workerGroupSpecs"]}
    assert set(groups) == {"prefill", "decode"}
    for name, resource in (("prefill", PREFILL_RESOURCE), ("decode", DECODE_RESOURCE)):
        group = groups[name]
        assert group["minReplicas"] <= group["replicas"] <= group["maxReplicas"]
        resources = json.loads(json.loads(group["rayStartParams"]["resources"]))
        gpus = int(group["template"]["spec"]["containers"][0]["resources"]["limits"]["nvidia.com/gpu"])
        assert resources == {resource: gpus}
    assert job["spec"]["rayClusterSpec"]["enableInTreeAutoscaling"] is True
    service_ports = {p["name"]: p["targetPort"] for p in docs["Service"]["spec"]["ports"]}
    assert service_ports == {"grpc": cfg.gateway.port, "http": cfg.http.port}
    head_ports = {p["containerPort"] for p in head["containers"][0]["ports"]}
    assert {cfg.gateway.port, cfg.http.port} <= head_ports
    assert docs["Service"]["spec"]["selector"].items() <= \
        job["spec"]["rayClusterSpec"]["headGroupSpec"]["template"]["metadata"]["labels"].items()


def test_prometheus_scrapes_the_http_front_metrics():
    prom = yaml.safe_load((DEPLOY / "prometheus" / "prometheus.yml").read_text())
    jobs = {j["job_name"]: j for j in prom["scrape_configs"]}
    assert all(j["metrics_path"] == "/metrics" for j in jobs.values())
    target = jobs["baton"]["static_configs"][0]["targets"][0]
    assert int(target.rsplit(":", 1)[1]) == ClusterConfig().http.port
    keep = jobs["baton-kubernetes"]["relabel_configs"][0]
    assert keep["regex"] == f"{_kuberay_docs()['Service']['metadata']['name']};http"


def test_dashboard_uses_exactly_the_metrics_baton_registers():
    registered = {name for name in prometheus_client.REGISTRY._names_to_collectors
                  if name.startswith("baton_")}
    used = dashboard_metric_names()
    assert used <= registered, used - registered
    bases = {re.sub(r"_(bucket|sum|count|total)$", "", n) for n in used}
    exposed = {re.sub(r"_(total)$", "", n) for n in metrics.METRIC_NAMES}
    assert bases == exposed  # every Baton metric has a panel, every panel a Baton metric


RUNBOOKS = sorted((DEPLOY / "runbooks").glob("*.md"))


@pytest.mark.parametrize("runbook", RUNBOOKS, ids=lambda p: p.name)
def test_runbook_commands_are_the_clis(runbook):
    commands = _baton_commands(runbook.read_text())
    if runbook.name != "README.md":
        assert commands, f"{runbook.name} shows no baton command"
    for argv in commands:
        try:
            ctx = _resolve(argv)
        except Exception as exc:  # typer's click errors: no such command, option, bad value
            pytest.fail(f"{runbook.name}: `baton {' '.join(argv)}`: {exc}")
        assert ctx.params, argv


def test_runbooks_cover_the_operations():
    names = {p.name for p in RUNBOOKS}
    assert {"scaling.md", "failed-worker.md", "affinity-threshold.md", "kv-store-full.md",
            "redis-down.md", "rolling-model.md"} <= names
    index = (DEPLOY / "runbooks" / "README.md").read_text()
    assert all(f"({n})" in index for n in names - {"README.md"})
    tuning = (DEPLOY / "runbooks" / "affinity-threshold.md").read_text()
    assert "conductor.tuning.baton_replication_margin_frac" in tuning
    assert "conductor.tuning.mooncake_kvcache_balancing_threshold" in tuning
    fields = ClusterConfig().conductor.tuning.model_fields
    assert {"baton_replication_margin_frac", "mooncake_kvcache_balancing_threshold"} <= set(fields)
