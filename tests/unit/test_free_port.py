"""``free_port``: a port for a server to bind, outside the range the kernel draws outgoing
connections' local ports from, never one something listens on, never the same one twice."""

from __future__ import annotations

import socket

from kvstore import redis_server
from kvstore.redis_server import free_port


def _ephemeral() -> tuple[int, int]:
    low, high = open("/proc/sys/net/ipv4/ip_local_port_range").read().split()
    return int(low), int(high)


def test_ports_are_bindable_distinct_and_outside_the_ephemeral_range():
    low, _ = _ephemeral()
    ports = [free_port() for _ in range(40)]
    assert len(set(ports)) == 40
    assert all(redis_server.LISTEN_PORTS[0] <= p < min(low, redis_server.LISTEN_PORTS[1] + 1)
               for p in ports)
    for p in ports:
        with socket.socket() as s:
            s.bind(("127.0.0.1", p))


def test_a_port_something_listens_on_is_never_picked(monkeypatch):
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        monkeypatch.setattr(redis_server, "LISTEN_PORTS", (port, port))
        monkeypatch.setattr(redis_server, "_ephemeral_low", lambda: 65_536)
        assert free_port() != port  # the only candidate is taken: the kernel's pick instead


def test_a_port_is_not_handed_out_twice(monkeypatch):
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    monkeypatch.setattr(redis_server, "LISTEN_PORTS", (port, port))
    monkeypatch.setattr(redis_server, "_ephemeral_low", lambda: 65_536)
    monkeypatch.setattr(redis_server, "_picked", set())
    assert free_port() == port
    assert free_port() != port
