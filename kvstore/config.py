"""Configuration of the KV store."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field


class TransferConfig(BaseModel):
    """The transfer engine: each store node serves its blocks to registered peers; clients pull
    batches of blocks by key. Same node: shared memory; other nodes: ``backend``."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    backend: Literal["tcp", "ucx"] = Field(
        "tcp", description="Data path between nodes: 'tcp' (asyncio sockets) or 'ucx' (ucxx; "
        "transports from ucx_options). A node with 'ucx' also serves 'tcp'."
    )
    listen_host: str = Field(
        "127.0.0.1", description="Address the block server binds (tcp and ucx listeners)."
    )
    advertise_host: str | None = Field(
        None, description="Address peers connect to; unset: listen_host."
    )
    listen_port: int = Field(
        0, ge=0, le=65535, description="TCP port of the block server; 0 picks a free one."
    )
    ucx_port: int = Field(
        0, ge=0, le=65535, description="UCX listener port (backend 'ucx'); 0 picks a free one."
    )
    ucx_options: dict[str, str] = Field(
        default_factory=lambda: {"TLS": "tcp", "WARN_UNUSED_ENV_VARS": "n"},
        description="UCX settings without the UCX_ prefix (TLS=tcp here; rc,cuda_copy,... on "
        "RDMA clusters). Applied once per process, when UCX is first used.",
    )
    ucx_progress_mode: Literal["blocking", "polling", "thread"] = Field(
        "blocking", description="ucxx progress mode; 'blocking' gives ~25 us round trips here."
    )
    same_node_shared_memory: bool = Field(
        True, description="Read a peer on the same machine straight from its arena file."
    )
    connect_timeout_s: float = Field(
        2.0, gt=0, description="Seconds to connect and authenticate to a peer."
    )
    request_timeout_s: float = Field(
        5.0, gt=0, description="Seconds one batched read may take end to end."
    )
    max_retries: int = Field(
        2, ge=0, description="Extra attempts after a failed connect or timed-out read."
    )
    retry_backoff_s: float = Field(
        0.05, ge=0, description="Seconds before the first retry; doubles on each later one."
    )
    token_file: str | None = Field(
        None, description="File holding the cluster's shared transfer secret; unset: the "
        "environment variable named by token_env."
    )
    token_env: str = Field(
        "BATON_TRANSFER_TOKEN", description="Environment variable holding the shared secret "
        "when token_file is unset."
    )
    bandwidth_ewma_alpha: float = Field(
        0.2, gt=0, le=1, description="Weight of the newest read in each path's bandwidth EWMA."
    )


class KVStoreConfig(BaseModel):
    """One store node per machine; its host tier is a shared-memory arena of block slots."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    host_capacity_bytes: int = Field(
        1 << 30, ge=1 << 20, description="Bytes of host DRAM each node's arena holds (rounded "
        "down to whole blocks)."
    )
    arena_dir: str = Field(
        "/dev/shm", description="Folder for the arena file; must be a memory-backed filesystem "
        "for zero-copy sharing between a node's workers."
    )
    disk_dir: str | None = Field(
        None, description="Folder of the SSD tier (one slot file of checksummed blocks); unset: no "
        "disk tier, so blocks evicted from host memory are dropped."
    )
    disk_capacity_bytes: int = Field(
        8 << 30, ge=1 << 20, description="Bytes the SSD tier may use on each node."
    )
    heartbeat_interval_s: float = Field(
        1.0, gt=0, description="Seconds between a node's liveness renewals in Redis."
    )
    heartbeat_ttl_s: float = Field(
        5.0, gt=0, description="Seconds after its last heartbeat that a node counts as dead and "
        "its block entries are removed by the other nodes."
    )
    holder_sweep_interval_s: float = Field(
        2.0, ge=0, description="Seconds between a node's looks for client processes that died "
        "holding reserved or pinned blocks (a worker killed mid-transfer); their blocks are "
        "released. 0: never looked for."
    )
    events_endpoint: str | None = Field(
        None, description="ZMQ address the node binds to publish its KV events (vLLM's wire "
        "format, medium CPU or DISK), e.g. tcp://127.0.0.1:5600; unset: no events."
    )
    events_replay_endpoint: str | None = Field(
        None, description="ZMQ address the node binds to replay missed event batches."
    )
    publish_to_redis: bool = Field(
        True, description="Record which node holds each block in Redis (cluster-wide metadata)."
    )
    transfer: TransferConfig | None = Field(
        None, description="Serve this node's blocks to peers (transfer engine); unset: no server."
    )
    lease_max_bytes: int | None = Field(
        None, ge=0, description="Bytes of blocks the live leases on one node may name in all "
        "(kvstore.leases: sessions' and cache_control prefixes, kept past plain LRU blocks); "
        "when a lease would exceed it, the oldest leases give way (their blocks become plain). "
        "Unset: half of host_capacity_bytes."
    )
    lease_max_bytes_per_tenant: int | None = Field(
        None, ge=0, description="Bytes of blocks one tenant's live leases may name on one node; "
        "that tenant's oldest leases give way first. Unset: a quarter of host_capacity_bytes."
    )

    def lease_caps_bytes(self) -> tuple[int, int]:
        """The global and the per-tenant cap on leased bytes, defaults resolved."""
        total = self.lease_max_bytes
        per_tenant = self.lease_max_bytes_per_tenant
        return (self.host_capacity_bytes // 2 if total is None else total,
                self.host_capacity_bytes // 4 if per_tenant is None else per_tenant)
