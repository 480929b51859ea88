"""Turn Baton's engine config into vLLM engine arguments for a role."""

from __future__ import annotations

from typing import Literal

import msgspec

from engine.config import EngineConfig
from engine.models import PreparedModel
from kvstore.attach import StoreWiring

Role = Literal["prefill", "decode", "plain"]

_KV_ROLE = {"prefill": "kv_both", "decode": "kv_both"}
"""Both roles load and save: a prefill engine loads a prefix another instance computed instead
of recomputing it; a decode engine saves what it computed itself (a co-located prefill's
prompt, the blocks a finished request's output completed) so the next step of the same agent,
wherever it lands, loads them."""


class EventsWiring(msgspec.Struct, frozen=True):
    """Where an engine publishes its KV events (the conductor binds ``endpoint``)."""

    endpoint: str
    replay_endpoint: str
    """Where this engine binds its replay socket, on its own host."""


def cpu_has_native_bf16() -> bool:
    """Whether this CPU computes bf16 natively (AVX512-BF16 or AMX)."""
    try:
        with open("/proc/cpuinfo") as f:
            flags = f.read()
    except OSError:
        return False
    return "avx512_bf16" in flags or "amx_bf16" in flags


def effective_dtype(config: EngineConfig, model: PreparedModel) -> str:
    """The dtype the engine (and so its KV cache) really runs in."""
    if config.dtype != "auto":
        return config.dtype
    if model.dtype_bytes == 4:
        return "float32"
    if config.device == "cpu" and not cpu_has_native_bf16():
        return "float32"
    return "bfloat16"


def dtype_bytes(dtype: str) -> int:
    return 4 if dtype == "float32" else 2


def engine_env(config: EngineConfig, omp_bind: str) -> dict[str, str]:
    """Environment a worker process needs *before* vLLM is imported.

    In-process engine core (no extra process per engine: ~3 s start instead of ~17 s), and on
    CPU the KV space, the OpenMP core binding and the bound on oneDNN's kernel cache.
    """
    env = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    if config.device == "cpu":
        env["VLLM_CPU_KVCACHE_SPACE"] = str(max(1, round(config.kv_cache_gib)))
        env["VLLM_CPU_OMP_THREADS_BIND"] = omp_bind
        if config.onednn_primitive_cache_capacity:
            env["ONEDNN_PRIMITIVE_CACHE_CAPACITY"] = str(config.onednn_primitive_cache_capacity)
    return env


def build_engine_args(
    config: EngineConfig,
    model: PreparedModel,
    role: Role,
    engine_id: str,
    store: StoreWiring | None,
    events: EventsWiring | None = None,
):
    """The ``vllm.EngineArgs`` for one instance. ``store`` is required unless role is plain.

    With ``events`` the engine publishes vLLM KV events (topic = ``engine_id``). A prefill engine
    schedules by priority, so the conductor can run the longest matched prefix first.
    """
    from vllm import EngineArgs
    from vllm.config import KVEventsConfig, KVTransferConfig, StructuredOutputsConfig

    kv_transfer = None
    if role != "plain":
        assert store is not None, "prefill and decode engines need a KV store"
        kv_transfer = KVTransferConfig(
            kv_connector="BatonConnector",
            kv_connector_module_path="kvstore.connector",
            kv_role=_KV_ROLE[role] if config.saves_prompts(role) else "kv_consumer",
            engine_id=engine_id,
            kv_load_failure_policy="recompute",
            kv_connector_extra_config={
                "engine_id": engine_id,
                "model_id": model.name,
                "store_actor": store.store_actor,
                "namespace": store.namespace,
                "async_transfers": config.async_kv_transfers,
                "sync_load_step_fraction": config.kv_sync_load_step_fraction,
                "lookup_wait_step_fraction": config.kv_lookup_wait_step_fraction,
                "lookup_wait_max_s": config.kv_lookup_wait_max_ms / 1000.0,
                "save_whole_prompts": role == "decode" and config.decode_saves == "per_prompt",
                # a decode engine's outputs are its clients' tokens: its saves start after
                # them; a prefill engine's saves are its hand-off and start at once
                "saves_after_outputs": role == "decode",
            },
        )
    max_len = min(config.max_model_len_tokens or model.max_model_len, model.max_model_len)
    kwargs = dict(
        model=str(model.path),
        served_model_name=model.name,
        max_model_len=max_len,
        enforce_eager=config.enforce_eager,
        enable_prefix_caching=True,
        max_num_seqs=config.max_num_seqs,
        kv_transfer_config=kv_transfer,
        seed=0,
        dtype=effective_dtype(config, model),
        structured_outputs_config=StructuredOutputsConfig(
            backend=config.structured_outputs_backend, disable_any_whitespace=config.compact_json),
    )
    if events is not None:
        kwargs["kv_events_config"] = KVEventsConfig(
            enable_kv_cache_events=True, publisher="zmq", endpoint=events.endpoint,
            replay_endpoint=events.replay_endpoint, topic=engine_id,
        )
    if config.num_kv_blocks is not None:
        kwargs["num_gpu_blocks_override"] = config.num_kv_blocks
    kwargs["block_size"] = config.kv_block_tokens
    step_tokens = config.step_token_budget(role)
    if step_tokens is not None:
        kwargs["max_num_batched_tokens"] = step_tokens
    if role == "prefill":
        kwargs["scheduling_policy"] = "priority"
    if config.device == "cuda":
        kwargs["gpu_memory_utilization"] = config.gpu_memory_utilization
    return EngineArgs(**kwargs)
