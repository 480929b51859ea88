"""The cluster config: one pydantic model per component (each defined in its own room:
``engine.config``, ``kvstore.config``, ``gateway.config``, ``conductor.config``), composed here,
loaded from YAML with overrides from the command line."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from conductor.config import ConductorConfig
from conductor.planner import PlannerConfig
from conductor.policy import SERVES_WITHOUT_PREFILL_POOL
from engine.config import EngineConfig
from gateway.config import AuthConfig, EngineGrpcConfig, GatewayConfig, HttpConfig
from gateway.sessions import SessionsConfig
from kvstore.config import KVStoreConfig
from protos.errors import ConfigError


class PoolConfig(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    num_instances: int = Field(1, ge=0, description="Instances in the pool at start.")


class RedisConfig(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    url: str | None = Field(
        None, description="redis:// URL of the metadata server; unset: start a local one."
    )
    password_file: str | None = Field(
        None, description="File holding the Redis password: a local server is started with it, "
        "and every client authenticates with it. Never in this config, never logged."
    )

    def password(self) -> str | None:
        """The password from ``password_file`` (None without one); ``ConfigError`` if unreadable."""
        from protos.errors import ConfigError

        if self.password_file is None:
            return None
        try:
            password = Path(self.password_file).read_text().strip()
        except OSError as e:
            raise ConfigError(f"redis.password_file: cannot read {self.password_file}: {e.strerror}") from e
        if not password or any(c in password for c in '"\\\n'):
            raise ConfigError(f"redis.password_file {self.password_file}: the password must be one "
                              "non-empty line without quotes or backslashes")
        return password

    def client_url(self, url: str) -> str:
        """``url`` with this config's password in it (unless the URL has its own)."""
        from kvstore.redis_server import with_password

        return with_password(url, self.password())


class RayConfig(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    address: str | None = Field(
        None, description="Existing Ray cluster ('auto' or host:port); unset: start a local one."
    )
    namespace: str = Field("baton", description="Ray namespace for Baton's named actors.")


class ClusterConfig(BaseModel):
    """Everything ``baton serve`` needs; every field has a default for one machine."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    name: str = Field("baton", pattern=r"^[a-z0-9][a-z0-9-]{0,31}$", description="Cluster name.")
    engine: EngineConfig = EngineConfig()
    prefill: PoolConfig = PoolConfig()
    decode: PoolConfig = PoolConfig()
    kvstore: KVStoreConfig = KVStoreConfig()
    gateway: GatewayConfig = GatewayConfig()
    http: HttpConfig = HttpConfig()
    auth: AuthConfig = AuthConfig()
    engine_grpc: EngineGrpcConfig = EngineGrpcConfig()
    sessions: SessionsConfig = SessionsConfig()
    conductor: ConductorConfig = ConductorConfig()
    autoscale: PlannerConfig = PlannerConfig()
    redis: RedisConfig = RedisConfig()
    ray: RayConfig = RayConfig()

    @model_validator(mode="after")
    def _some_front(self) -> "ClusterConfig":
        if not (self.gateway.enabled or self.http.enabled):
            raise ValueError("gateway.enabled and http.enabled are both false: enable a front")
        if self.prefill.num_instances == 0 and self.conductor.policy not in SERVES_WITHOUT_PREFILL_POOL:
            raise ValueError(
                f"prefill.num_instances is 0 but conductor.policy '{self.conductor.policy}' needs a "
                f"prefill instance; only {sorted(SERVES_WITHOUT_PREFILL_POOL)} serve co-located "
                "(every prefill on its decode instance)"
            )
        return self


def _set_dotted(data: dict[str, Any], dotted: str, value: Any) -> None:
    parts = dotted.split(".")
    node = data
    for part in parts[:-1]:
        node = node.setdefault(part, {})
        if not isinstance(node, dict):
            raise ConfigError(f"override '{dotted}': '{part}' is not a section")
    node[parts[-1]] = value


def load_config(path: str | Path | None = None, overrides: dict[str, Any] | None = None) -> ClusterConfig:
    """Read ``path`` (YAML; missing: all defaults), apply dotted ``overrides``, validate.

    Raises ``ConfigError`` naming the file and field for anything invalid.
    """
    data: dict[str, Any] = {}
    if path is not None:
        p = Path(path)
        if not p.exists():
            raise ConfigError(f"config file {p} does not exist")
        try:
            loaded = yaml.safe_load(p.read_text()) or {}
        except yaml.YAMLError as exc:
            raise ConfigError(f"{p} is not valid YAML: {exc}") from exc
        if not isinstance(loaded, dict):
            raise ConfigError(f"{p} must hold a mapping at the top level")
        data = loaded
    for dotted, value in (overrides or {}).items():
        _set_dotted(data, dotted, value)
    try:
        return ClusterConfig.model_validate(data)
    except ValidationError as exc:
        where = f" in {path}" if path else ""
        problems = "; ".join(
            f"{'.'.join(str(x) for x in err['loc'])}: {err['msg']}" for err in exc.errors()
        )
        raise ConfigError(f"invalid config{where}: {problems}") from exc
