"""The block server: one per store node, serving the node's blocks to authenticated peers.

It listens on TCP always (the control path of same-machine shared-memory reads, and the ``tcp``
data path) and on UCX when the node's backend is ``ucx``. For each ``ReadRequest`` it pins the
leading run of requested blocks the node holds (host tier, or promoted from the disk tier with
its checksum verified), sends their checksums and bytes straight from the arena, and unpins them
once the bytes are out (see ``kvstore.transfer_wire`` for the protocol). A peer whose handshake
proof is wrong is refused and counted.
"""

from __future__ import annotations

import asyncio
import errno
import logging
import os
import signal
import socket
from collections.abc import Sequence
from typing import Any, Protocol

import msgspec

from kvstore.config import TransferConfig
from kvstore.host_arena import HostArena
from kvstore.keys import BlockKey
from kvstore.leases import LeaseGrant
from kvstore.transfer_wire import (
    NONCE_BYTES,
    PROTOCOL_VERSION,
    Challenge,
    Hello,
    ProtocolError,
    ReadReply,
    ReadRequest,
    Refused,
    Release,
    TransferConfigError,
    Welcome,
    decode,
    encode,
    ensure_ucx,
    expect,
    load_secret,
    proof_is_valid,
    recv_frame,
    run_sync,
    send_frame,
    this_host_id,
    transfer_loop,
)

log = logging.getLogger(__name__)


class PinnedRun(msgspec.Struct, frozen=True):
    """The leading run of requested keys a source pinned: ``slots[i]`` holds ``keys[i]``, whose
    bytes hash to ``checksums[i]`` (``block_checksum``); ``leases`` are the live leases naming
    any of them, to travel with the blocks."""

    keys: list[BlockKey]
    slots: list[int]
    from_disk: list[bool]
    checksums: list[int]
    leases: list[LeaseGrant] = []


class BlockSource(Protocol):
    """What the server needs from a store node (``KVStoreNode`` implements it)."""

    node_id: str
    arena: HostArena

    def pin_for_transfer(self, keys: Sequence[BlockKey]) -> PinnedRun:
        """Pin the leading run of ``keys`` held in host memory (promoting disk hits first)."""

    def release(self, keys: Sequence[BlockKey]) -> None:
        """Unpin keys pinned by ``pin_for_transfer``."""


class PeerAddress(msgspec.Struct, frozen=True):
    """Where a node's block server listens; published in Redis for the other nodes."""

    node_id: str
    host: str
    tcp_port: int
    ucx_port: int | None = None


class ServerStats(msgspec.Struct, frozen=True):
    requests: int
    served_blocks: int
    served_bytes: int
    served_from_disk_blocks: int
    refused_handshakes: int
    open_connections: int


class BlockServer:
    """Serves ``source``'s blocks on the process's transfer loop. ``start`` binds the listeners
    (raising ``TransferConfigError`` for a port in use); ``close`` stops them and unpins what
    in-flight requests held."""

    def __init__(self, source: BlockSource, config: TransferConfig,
                 secret: bytes | None = None) -> None:
        self._source = source
        self._config = config
        self._secret = secret if secret is not None else load_secret(config)
        self._slot_views = source.arena.slots.numpy()  # (num_slots, slot_bytes) uint8, no copy
        self._welcome = Welcome(
            node_id=source.node_id, host_id=this_host_id(), block_bytes=source.arena.slot_bytes,
            arena_path=str(source.arena.path), num_slots=source.arena.num_slots,
        )
        self._listen_sock: socket.socket | None = None
        self._ucx_listener: Any = None
        self._accept_task: asyncio.Task | None = None
        self._tasks: set[asyncio.Task] = set()  # one per open connection
        self._requests = self._blocks = self._bytes = self._disk_blocks = self._refused = 0
        self.address: PeerAddress | None = None
        self.die_mid_stream = False
        """Drill hook (``KVStoreNode.crash_mid_pull``): the next streamed reply kills this
        process (SIGKILL) with half of its blocks sent."""

    # -- lifecycle ---------------------------------------------------------------------------

    def start(self) -> PeerAddress:
        self.address = run_sync(self._start())
        log.info("block server of %s listening: %s", self._source.node_id, self.address)
        return self.address

    def close(self) -> None:
        run_sync(self._close())

    def stats(self) -> ServerStats:
        return ServerStats(
            requests=self._requests, served_blocks=self._blocks, served_bytes=self._bytes,
            served_from_disk_blocks=self._disk_blocks, refused_handshakes=self._refused,
            open_connections=len(self._tasks),
        )

    async def _start(self) -> PeerAddress:
        config = self._config
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((config.listen_host, config.listen_port))
        except OSError as e:
            sock.close()
            hint = ("the port is in use: choose another kvstore.transfer.listen_port (0 = any)"
                    if e.errno == errno.EADDRINUSE else str(e))
            raise TransferConfigError(
                f"block server cannot listen on {config.listen_host}:{config.listen_port}: {hint}"
            ) from e
        sock.listen(64)
        sock.setblocking(False)
        self._listen_sock = sock
        self._accept_task = asyncio.get_running_loop().create_task(self._accept_forever(sock))
        ucx_port = None
        if config.backend == "ucx":
            ucxx = ensure_ucx(config)
            try:
                self._ucx_listener = ucxx.create_listener(self._serve_ucx, config.ucx_port or None)
            except Exception as e:
                raise TransferConfigError(
                    f"UCX listener cannot start on port {config.ucx_port}: {e}; choose another "
                    "kvstore.transfer.ucx_port (0 = any) or backend 'tcp'"
                ) from e
            ucx_port = self._ucx_listener.port
        host = config.advertise_host or config.listen_host
        return PeerAddress(self._source.node_id, host, sock.getsockname()[1], ucx_port)

    async def _close(self) -> None:
        if self._accept_task is not None:
            self._accept_task.cancel()
            self._accept_task = None
        if self._listen_sock is not None:
            self._listen_sock.close()
            self._listen_sock = None
        tasks = list(self._tasks)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await asyncio.sleep(0)  # let the UCX listener see its handlers finish
        if self._ucx_listener is not None:
            self._ucx_listener.close()
            self._ucx_listener = None

    def _spawn(self, coroutine) -> None:
        task = transfer_loop().create_task(coroutine)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    # -- TCP ---------------------------------------------------------------------------------

    async def _accept_forever(self, listen_sock: socket.socket) -> None:
        loop = asyncio.get_running_loop()
        while True:
            sock, _ = await loop.sock_accept(listen_sock)
            sock.setblocking(False)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            self._spawn(self._serve_tcp(sock))

    async def _serve_tcp(self, sock: socket.socket) -> None:
        loop = asyncio.get_running_loop()
        try:
            nonce = os.urandom(NONCE_BYTES)
            await send_frame(sock, Challenge(PROTOCOL_VERSION, nonce))
            hello = await asyncio.wait_for(recv_frame(sock), self._config.connect_timeout_s)
            if not self._admit(hello, nonce):
                await send_frame(sock, Refused("wrong transfer secret"))
                return
            await send_frame(sock, self._welcome)
            while True:
                request = expect(await recv_frame(sock), ReadRequest)
                run = self._pin(request.keys)
                try:
                    views = [self._slot_views[slot] for slot in run.slots]
                    await send_frame(sock, self._reply(request, run))
                    if request.mode == "stream":
                        for i, view in enumerate(views):
                            self._maybe_die(i, len(views))
                            # a memoryview: uvloop (Ray's loop) cannot take a numpy array here
                            await loop.sock_sendall(sock, memoryview(view))
                    else:  # the client copies from the arena, then says so
                        expect(await recv_frame(sock), Release)
                    self._count(run)
                finally:
                    self._source.release(run.keys)
        except (ConnectionError, asyncio.TimeoutError, asyncio.IncompleteReadError):
            pass  # the client went away: its pins were released above
        except (ProtocolError, OSError) as e:
            log.warning("block server: dropping a TCP peer: %s", e)
        except Exception:  # noqa: BLE001 - a bug must not go unseen in a never-awaited task
            log.exception("block server: dropping a TCP peer after an unexpected error")
        finally:
            sock.close()

    # -- UCX ---------------------------------------------------------------------------------

    async def _serve_ucx(self, endpoint) -> None:
        from ucxx.exceptions import UCXError

        self._spawn_current()
        try:
            nonce = os.urandom(NONCE_BYTES)
            await endpoint.send_obj(encode(Challenge(PROTOCOL_VERSION, nonce)))
            hello = decode(await asyncio.wait_for(endpoint.recv_obj(),
                                                  self._config.connect_timeout_s))
            if not self._admit(hello, nonce):
                await endpoint.send_obj(encode(Refused("wrong transfer secret")))
                return
            await endpoint.send_obj(encode(self._welcome))
            while True:
                request = expect(decode(await endpoint.recv_obj()), ReadRequest)
                run = self._pin(request.keys)
                try:
                    views = [self._slot_views[slot] for slot in run.slots]
                    await endpoint.send_obj(encode(self._reply(request, run)))
                    if request.mode == "stream":
                        half = len(views) // 2 if self.die_mid_stream else len(views)
                        await asyncio.gather(*(endpoint.send(view) for view in views[:half]))
                        self._maybe_die(half, len(views))
                        await asyncio.gather(*(endpoint.send(view) for view in views[half:]))
                    else:
                        expect(decode(await endpoint.recv_obj()), Release)
                    self._count(run)
                finally:
                    self._source.release(run.keys)
        except (UCXError, ConnectionError, asyncio.TimeoutError):
            pass
        except ProtocolError as e:
            log.warning("block server: dropping a UCX peer: %s", e)
        finally:
            endpoint.abort()

    def _spawn_current(self) -> None:
        """Track a listener-started handler task so ``close`` cancels it too."""
        task = asyncio.current_task()
        if task is not None:
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    # -- shared ------------------------------------------------------------------------------

    def _admit(self, hello, nonce: bytes) -> bool:
        hello = expect(hello, Hello)
        if proof_is_valid(self._secret, nonce, hello.proof):
            return True
        self._refused += 1
        log.warning("block server of %s refused peer %r: wrong transfer secret",
                    self._source.node_id, hello.node_id)
        return False

    def _maybe_die(self, sent: int, total: int) -> None:
        """The drill's crash mid-pull, as the source: once half of a reply's blocks are out."""
        if self.die_mid_stream and total and sent == total // 2:
            log.warning("block server of %s: dying mid-pull (%d of %d blocks sent), as the "
                        "drill asked", self._source.node_id, sent, total)
            os.kill(os.getpid(), signal.SIGKILL)

    def _pin(self, keys: list[bytes]) -> PinnedRun:
        return self._source.pin_for_transfer([BlockKey(k) for k in keys])

    def _reply(self, request: ReadRequest, run: PinnedRun) -> ReadReply:
        return ReadReply(
            request_id=request.request_id,
            checksums=run.checksums,
            from_disk=run.from_disk,
            slots=run.slots if request.mode == "shm" else [],
            leases=run.leases,
        )

    def _count(self, run: PinnedRun) -> None:
        self._requests += 1
        self._blocks += len(run.slots)
        self._bytes += len(run.slots) * self._welcome.block_bytes
        self._disk_blocks += sum(run.from_disk)
