"""The fronts' config models: the gRPC gateway, the OpenAI HTTP front and client authentication."""

from __future__ import annotations

from pathlib import Path

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator


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
    decode_stream: Literal["multiplexed", "per_request"] = Field(
        "multiplexed", description="How tokens come back from a decode instance: "
        "'multiplexed', one Ray stream per instance carrying every request's tokens of an engine "
        "step as one item; 'per_request', one Ray stream per request, an item per token (the "
        "earlier path: on a CPU its crossings slowed decode steps ~1.25x, docs/benchmarks.md)."
    )
    lookup_device_hits: bool = Field(
        True, description="Whether a co-located prefill whose reusable prefix the conductor's "
        "index places wholly in its engine's own device cache still asks the node's store for "
        "the prompt's blocks. true: it asks (the index can be wrong: `baton bench itl` found "
        "requests that skipped the lookup computing whole 3,000-token prompts on the decode "
        "engine, 3-4.5 s gaps in its streams; asking, 0.3 s; docs/benchmarks.md); false: it "
        "does not (one store round trip less; no TTFT effect measured in the peers race)."
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
        from protos.errors import ConfigError

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
    tool_call_parser: Literal["hermes", "json"] = Field(
        "hermes", description="The format the served model calls tools in: 'hermes' "
        "(<tool_call>{...}</tool_call>; Baton's default rendering of tools, SmolLM2, Qwen, "
        "Hermes) or 'json' (the whole answer is a JSON call; Llama 3.x). Forced calls "
        "(tool_choice required or a named function) are held to a grammar either way."
    )

    @model_validator(mode="after")
    def _tls_needs_both_files(self) -> "HttpConfig":
        _check_tls_pair("http", self.tls_cert_file, self.tls_key_file)
        return self

    def tls_files(self) -> tuple[str, str] | None:
        """(certificate chain, private key) paths, checked to load as a TLS server identity, or
        None without TLS; ``ConfigError`` naming the field when a file is unreadable or wrong."""
        import ssl

        from protos.errors import ConfigError

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


class EngineGrpcConfig(BaseModel):
    """The engine gRPC contract (``vllm.grpc.engine.VllmEngine``, PyPI ``smg-grpc-proto``) that
    SMG and other clients of vLLM's ``--grpc`` mode speak: the whole cluster behind one worker
    URL. Off unless ``port`` is set; behind the gateway's API keys (``auth``) and TLS switch
    (``gateway.tls_cert_file``)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    port: int | None = Field(
        None, ge=0, le=65535, description="Port of the engine gRPC contract; unset: not served; "
        "0 picks a free one."
    )
    host: str = Field("127.0.0.1", description="Address the engine gRPC contract binds.")
    require_api_key: bool = Field(
        True, description="With auth.api_key_file set, every call must carry one of its keys "
        "(authorization: Bearer), as on the fronts. false: calls without a key are served, for "
        "routers that send none to their gRPC workers (SMG 1.13 does not): keep the port on "
        "loopback or a private network then."
    )


class AuthConfig(BaseModel):
    """Client authentication, shared by the gRPC gateway and the HTTP front."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    api_key_file: str | None = Field(
        None, description="File with one accepted API key per line; unset: no key required. "
        "Keys are read from the file, never from the config itself, and never logged."
    )
