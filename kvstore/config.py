"""Configuration of the KV store."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field


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
        None, description="Folder of the SSD tier (one checksummed file per block); unset: no "
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
