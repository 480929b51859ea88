"""The cluster config: one pydantic model per component, composed, loaded from YAML with
overrides from the command line."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from conductor.errors import ConfigError
from conductor.policy import POLICIES, SERVES_WITHOUT_PREFILL_POOL, PolicyConfig
from engine.config import EngineConfig
from kvstore.config import KVStoreConfig


class PoolConfig(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    num_instances: int = Field(1, ge=0, description="Instances in the pool at start.")


def _check_tls_pair(section: str, cert_file: str | None, key_file: str | None) -> None:
    if (cert_file is None) != (key_file is None):
        raise ValueError(f"{section} TLS needs both tls_cert_file and tls_key_file (or neither)")


class GatewayConfig(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    enabled: bool = Field(True, description="Serve the gRPC Inference API.")
    host: str = Field("127.0.0.1", description="Address the gRPC gateway binds.")
    port: int = Field(50051, ge=0, le=65535, description="gRPC port; 0 picks a free one.")
    tls_cert_file: str | None = Field(
        None, description="PEM certificate chain: set it (with tls_key_file) and the gateway "
        "serves TLS only; unset: plaintext (keep it on loopback or a private network)."
    )
    tls_key_file: str | None = Field(
        None, description="PEM private key of tls_cert_file; read from the file, never logged."
    )
    admin_key_file: str | None = Field(
        None, description="File with one accepted admin key per line: the baton.v1.Admin service "
        "(status, scale, drain, pin, unpin) on the gateway's port accepts only these keys, never "
        "an inference API key. Unset: the key in $BATON_ADMIN_KEY of the gateway's process; "
        "neither: the Admin service refuses every call. Read from the file, never logged."
    )

    @model_validator(mode="after")
    def _tls_needs_both_files(self) -> "GatewayConfig":
        _check_tls_pair("gateway", self.tls_cert_file, self.tls_key_file)
        return self

    def tls_credentials(self) -> tuple[bytes, bytes] | None:
        """(private key, certificate chain) PEM bytes, or None without TLS; ``ConfigError``
        naming the file when one cannot be read."""
        from conductor.errors import ConfigError

        if self.tls_cert_file is None or self.tls_key_file is None:
            return None
        pems = []
        for field, path in (("tls_key_file", self.tls_key_file), ("tls_cert_file", self.tls_cert_file)):
            try:
                pems.append(Path(path).read_bytes())
            except OSError as e:
                raise ConfigError(f"gateway.{field}: cannot read {path}: {e.strerror}") from e
        return pems[0], pems[1]


class HttpConfig(BaseModel):
    """The OpenAI-compatible HTTP front, served beside gRPC through the same conductor."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    enabled: bool = Field(True, description="Serve the OpenAI-compatible HTTP API.")
    host: str = Field("127.0.0.1", description="Address the HTTP front binds.")
    port: int = Field(8000, ge=0, le=65535, description="HTTP port; 0 picks a free one.")
    tls_cert_file: str | None = Field(
        None, description="PEM certificate chain: set it (with tls_key_file) and the HTTP front "
        "serves HTTPS only (/v1, /health and /metrics); unset: plain HTTP. May be the gateway's."
    )
    tls_key_file: str | None = Field(
        None, description="PEM private key of tls_cert_file; read from the file, never logged."
    )

    @model_validator(mode="after")
    def _tls_needs_both_files(self) -> "HttpConfig":
        _check_tls_pair("http", self.tls_cert_file, self.tls_key_file)
        return self

    def tls_files(self) -> tuple[str, str] | None:
        """(certificate chain, private key) paths, checked to load as a TLS server identity, or
        None without TLS; ``ConfigError`` naming the field when a file is unreadable or wrong."""
        import ssl

        from conductor.errors import ConfigError

        if self.tls_cert_file is None or self.tls_key_file is None:
            return None
        for field, path in (("tls_cert_file", self.tls_cert_file), ("tls_key_file", self.tls_key_file)):
            try:
                Path(path).read_bytes()
            except OSError as e:
                raise ConfigError(f"http.{field}: cannot read {path}: {e.strerror}") from e
        try:
            ssl.create_default_context(ssl.Purpose.CLIENT_AUTH).load_cert_chain(
                self.tls_cert_file, self.tls_key_file)
        except ssl.SSLError as e:
            raise ConfigError(
                f"http.tls_cert_file {self.tls_cert_file} and http.tls_key_file: not a PEM "
                f"certificate chain and its private key ({e.reason or e})"
            ) from e
        return self.tls_cert_file, self.tls_key_file


class AuthConfig(BaseModel):
    """Client authentication, shared by the gRPC gateway and the HTTP front."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    api_key_file: str | None = Field(
        None, description="File with one accepted API key per line; unset: no key required. "
        "Keys are read from the file, never from the config itself, and never logged."
    )


class ConductorConfig(BaseModel):
    """Placement: the policy, its knobs and SLOs, the cost profile, coalescing."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    policy: str = Field("baton", description="Placement policy (see conductor.policy).")
    stats_interval_s: float = Field(
        0.5, gt=0, description="Seconds between refreshes of worker load in the snapshot."
    )
    profile_path: str | None = Field(
        None, description="Cost profile written by `baton profile` (prefill, decode and transfer "
        "models); unset: the built-in placeholder figures for vLLM-CPU."
    )
    tuning: PolicyConfig = Field(
        PolicyConfig(), description="Policy knobs and the TTFT/TBT SLOs (conductor.policy.PolicyConfig); "
        "block size, KV bytes per token and the cost models are set from the model and the profile."
    )
    coalesce: bool = Field(
        True, description="Requests sharing a prefix that is being prefilled right now wait for it "
        "instead of computing it again."
    )
    coalesce_min_blocks: int = Field(
        4, ge=1, description="Wait only when at least this many of the request's blocks are being "
        "computed by one in-flight prefill (blocks)."
    )
    coalesce_max_wait_ms: float = Field(
        10_000.0, gt=0, description="Longest a request waits for that prefill before placing "
        "without it (ms)."
    )

    @field_validator("policy")
    @classmethod
    def _known_policy(cls, value: str) -> str:
        if value not in POLICIES:
            raise ValueError(f"unknown policy '{value}'; choose one of {sorted(POLICIES)}")
        return value


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
        from conductor.errors import ConfigError

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
    conductor: ConductorConfig = ConductorConfig()
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
