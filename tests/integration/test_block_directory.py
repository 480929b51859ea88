"""Block metadata in a real redis-server: who holds what, heartbeats, and the removal of a node
that stopped heartbeating."""

from __future__ import annotations

import time

import pytest

from kvstore.config import KVStoreConfig
from kvstore.keys import KeyExtras, block_keys
from kvstore.metadata import BlockDirectory
from kvstore.node import KVStoreNode
from kvstore.redis_server import start_local_redis

BLOCK_BYTES = 256 * 1024


@pytest.fixture
def redis_url():
    server = start_local_redis()
    yield server.url
    server.stop()


def keys(seed: int, n: int):
    return block_keys([seed * 1000 + i for i in range(4 * n)], 4, KeyExtras(model_id="m"))


def test_publish_locate_and_deregister(redis_url):
    directory = BlockDirectory.from_url(redis_url)
    a, b = keys(1, 3), keys(2, 2)
    directory.register("n1", "arena-1", ttl_s=30)
    directory.register("n2", "arena-2", ttl_s=30)
    directory.publish("n1", stored=a)
    directory.publish("n2", stored=a[:1] + b, tier="disk")
    directory.publish("n1", removed=a[2:])

    assert directory.locate(a) == [{"n1": "host", "n2": "disk"}, {"n1": "host"}, {}]
    assert directory.locate(b) == [{"n2": "disk"}, {"n2": "disk"}]
    assert directory.nodes() == {"n1": "arena-1", "n2": "arena-2"}

    directory.deregister("n2")
    assert directory.locate(a[:1] + b) == [{"n1": "host"}, {}, {}]
    assert directory.nodes() == {"n1": "arena-1"}


def _node(tmp_path, name: str, redis_url: str) -> KVStoreNode:
    config = KVStoreConfig(host_capacity_bytes=4 * BLOCK_BYTES, arena_dir=str(tmp_path),
                           heartbeat_interval_s=0.1, heartbeat_ttl_s=0.5)
    return KVStoreNode(name, "t", config, BLOCK_BYTES, redis_url)


def _write(node: KVStoreNode, chain) -> None:
    slots = node.reserve(chain, [None] + list(chain[:-1]))
    assert None not in slots
    node.commit(chain)


def test_a_node_that_stops_heartbeating_loses_its_entries(tmp_path, redis_url):
    directory = BlockDirectory.from_url(redis_url)
    survivor, doomed = _node(tmp_path, "alive", redis_url), _node(tmp_path, "doomed", redis_url)
    try:
        mine, theirs = keys(1, 2), keys(2, 2)
        _write(survivor, mine)
        _write(doomed, theirs)
        time.sleep(1.0)  # twice the TTL: both heartbeat, nobody is reaped
        assert directory.locate(theirs) == [{"doomed": "host"}] * 2
        assert set(directory.nodes()) == {"alive", "doomed"}

        doomed._stop_heartbeat.set()  # the process hangs or dies: no more heartbeats, no goodbye
        deadline = time.monotonic() + 5
        while "doomed" in directory.nodes() and time.monotonic() < deadline:
            time.sleep(0.1)

        assert directory.nodes() == {"alive": str(survivor.arena.path)}
        assert directory.locate(theirs) == [{}, {}]
        assert directory.locate(mine) == [{"alive": "host"}] * 2
    finally:
        survivor.shutdown()
        doomed.shutdown()
    assert directory.nodes() == {}
    assert directory.locate(mine) == [{}, {}]


def test_a_password_protected_redis_refuses_strangers_and_serves_the_store(tmp_path):
    """``redis.password_file``: the local server requires the password (kept off its command
    line), clients without it are refused, and a store node given the URL works as usual."""
    import redis as redis_py

    from cluster.config import RedisConfig
    from kvstore.redis_server import redacted, start_local_redis

    secret = tmp_path / "redis-password"
    secret.write_text("correct-horse-battery\n")
    config = RedisConfig(password_file=str(secret))
    server = start_local_redis(password=config.password())
    try:
        assert "correct-horse-battery" not in " ".join(server.process.args)
        with pytest.raises(redis_py.AuthenticationError):
            redis_py.Redis(port=server.port).set("k", "v")
        with pytest.raises(redis_py.AuthenticationError):
            redis_py.Redis(port=server.port, password="guessed").ping()

        url = config.client_url(f"redis://127.0.0.1:{server.port}/0")
        assert url == server.url and redacted(url) == f"redis://:***@127.0.0.1:{server.port}/0"
        node = _node(tmp_path, "n-auth", url)
        try:
            chain = keys(7, 2)
            _write(node, chain)
            assert BlockDirectory.from_url(url).locate(chain) == [{"n-auth": "host"}] * 2
        finally:
            node.shutdown()
    finally:
        server.stop()


def test_after_a_redis_restart_each_node_puts_its_blocks_back_by_itself(tmp_path):
    """Redis keeps no snapshot: a restart loses every entry. The node keeps serving meanwhile
    (writes succeed while Redis is down) and, at its next heartbeat after Redis is back,
    re-registers with every block it holds."""
    from kvstore.redis_server import start_local_redis

    server = start_local_redis()
    port = server.port
    node = _node(tmp_path, "n-restart", server.url)
    try:
        before, during = keys(8, 2), keys(9, 1)
        _write(node, before)
        assert BlockDirectory.from_url(server.url).locate(before) == [{"n-restart": "host"}] * 2

        server.stop()
        _write(node, during)  # Redis is down: the block is stored, its metadata waits
        server = start_local_redis(port=port)
        directory = BlockDirectory.from_url(server.url)
        deadline = time.monotonic() + 5
        while directory.nodes() == {} and time.monotonic() < deadline:
            time.sleep(0.05)

        assert directory.nodes() == {"n-restart": str(node.arena.path)}
        assert directory.locate(before + during) == [{"n-restart": "host"}] * 3
    finally:
        node.shutdown()
        server.stop()


def test_a_node_started_again_under_its_id_drops_what_its_previous_process_left(tmp_path, redis_url):
    """A store node killed without deregistering leaves its block entries; the node that takes
    its id replaces them with what it holds (nothing yet), so no reader is sent to blocks that
    died with the old process."""
    old = _node(tmp_path, "n-again", redis_url)
    lost = keys(10, 2)
    _write(old, lost)
    old._stop_heartbeat.set()  # killed: no deregistration
    directory = BlockDirectory.from_url(redis_url)
    assert directory.locate(lost) == [{"n-again": "host"}] * 2

    (tmp_path / "new").mkdir()  # this test's two processes share a pid: one arena folder each
    new = _node(tmp_path / "new", "n-again", redis_url)
    try:
        assert directory.locate(lost) == [{}, {}]
        assert directory.nodes() == {"n-again": str(new.arena.path)}
        kept = keys(11, 1)
        _write(new, kept)
        assert directory.locate(kept) == [{"n-again": "host"}]
    finally:
        new.shutdown()
        old.arena.close()
        old.arena.unlink()


def test_a_node_started_while_redis_is_down_registers_once_it_is_back(tmp_path):
    from kvstore.redis_server import free_port, start_local_redis

    port = free_port()
    node = _node(tmp_path, "n-late", f"redis://127.0.0.1:{port}/0")  # nothing listens yet
    server = start_local_redis(port=port)
    try:
        chain = keys(12, 2)
        _write(node, chain)  # published directly, or at registration
        directory = BlockDirectory.from_url(server.url)
        deadline = time.monotonic() + 5
        while directory.nodes() == {} and time.monotonic() < deadline:
            time.sleep(0.05)
        assert directory.nodes() == {"n-late": str(node.arena.path)}
        assert directory.locate(chain) == [{"n-late": "host"}] * 2
    finally:
        node.shutdown()
        server.stop()


def test_what_a_node_could_not_publish_while_redis_was_unreachable_is_put_right(tmp_path, redis_url):
    """A Redis that keeps its data but could not be reached for a while (a network blip, not a
    restart) missed an eviction and a commit; at its next heartbeat after that, the node puts
    the directory back to exactly what it holds: the evicted blocks' entries gone, the new ones
    there."""
    node = _node(tmp_path, "n-blip", redis_url)
    directory = BlockDirectory.from_url(redis_url)
    try:
        old, kept = keys(13, 2), keys(14, 2)
        _write(node, old)
        _write(node, kept)  # the host tier holds 4 blocks: full
        publish = BlockDirectory.publish

        def unreachable(*args, **kwargs):
            raise ConnectionError("Redis unreachable")

        BlockDirectory.publish = unreachable  # every writer of the node (its heartbeat's too)
        try:
            time.sleep(0.3)  # heartbeats go on: the node is registered all along
            new = keys(15, 2)
            _write(node, new)  # evicts the least recently used: `old`; neither change is published
            time.sleep(0.3)  # heartbeats try to put it right, and cannot
            assert directory.locate(old + new) == [{"n-blip": "host"}] * 2 + [{}, {}]
        finally:
            BlockDirectory.publish = publish

        deadline = time.monotonic() + 5
        while directory.locate(old + new) != [{}, {}] + [{"n-blip": "host"}] * 2 and (
                time.monotonic() < deadline):
            time.sleep(0.05)
        assert directory.locate(old + kept + new) == [{}, {}] + [{"n-blip": "host"}] * 4
        assert directory.node_block_keys("n-blip") == set(kept + new)
        assert node.tiers(old + kept + new) == [None, None] + ["host"] * 4
    finally:
        node.shutdown()
