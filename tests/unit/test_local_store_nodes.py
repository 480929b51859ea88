"""The local cluster's store-node layout (``LocalCluster.store_nodes``): one node for every
worker, or prefill on ``node0`` and decode on ``node1`` pulling from each other. A layout that
cannot work is a config error before anything starts."""

from __future__ import annotations

import pytest

from cluster.config import load_config
from cluster.local import LocalCluster
from protos.errors import ConfigError

TRANSFER = {"kvstore.transfer.backend": "tcp", "kvstore.transfer.listen_port": 7100,
            "kvstore.events_endpoint": "tcp://127.0.0.1:5600"}


def test_two_nodes_split_the_roles_and_one_node_serves_both():
    two = LocalCluster(load_config(None, TRANSFER), store_nodes=2)
    assert two.store_node_ids == ["node0", "node1"]
    assert (two.store_node_for("prefill"), two.store_node_for("decode")) == ("node0", "node1")
    one = LocalCluster(load_config(None, {}))
    assert one.store_node_ids == ["node0"]
    assert (one.store_node_for("prefill"), one.store_node_for("decode")) == ("node0", "node0")


def test_the_second_node_gets_its_own_ports_and_the_first_keeps_the_configured_ones():
    cluster = LocalCluster(load_config(None, TRANSFER), store_nodes=2)
    first, second = cluster._store_config("node0"), cluster._store_config("node1")
    assert (first.events_endpoint, first.transfer.listen_port) == ("tcp://127.0.0.1:5600", 7100)
    assert second.transfer.listen_port == 0 and second.transfer.backend == "tcp"
    assert second.events_endpoint.startswith("tcp://127.0.0.1:")
    assert second.events_endpoint not in (first.events_endpoint, first.events_replay_endpoint)
    assert cluster.store_actor_name_of("node1") == "baton-kvstore-node1"


def test_two_nodes_without_a_transfer_engine_or_three_nodes_fail_before_anything_starts():
    with pytest.raises(ConfigError, match="kvstore.transfer"):
        LocalCluster(load_config(None, {}), store_nodes=2).start()
    with pytest.raises(ConfigError, match="1 or 2"):
        LocalCluster(load_config(None, TRANSFER), store_nodes=3).start()


def test_two_nodes_share_the_operators_transfer_secret_or_a_fresh_one(monkeypatch):
    monkeypatch.delenv("BATON_TRANSFER_TOKEN", raising=False)
    fresh = LocalCluster(load_config(None, TRANSFER), store_nodes=2)
    fresh._check_store_nodes()
    assert list(fresh._transfer_env) == ["BATON_TRANSFER_TOKEN"]
    assert len(fresh._transfer_env["BATON_TRANSFER_TOKEN"]) == 32
    monkeypatch.setenv("BATON_TRANSFER_TOKEN", "operator-secret")
    configured = LocalCluster(load_config(None, TRANSFER), store_nodes=2)
    configured._check_store_nodes()
    assert configured._transfer_env == {"BATON_TRANSFER_TOKEN": "operator-secret"}
    from_file = LocalCluster(load_config(None, {**TRANSFER, "kvstore.transfer.token_file": "/s"}),
                             store_nodes=2)
    from_file._check_store_nodes()
    assert from_file._transfer_env == {}  # each node reads the file itself
