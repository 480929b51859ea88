"""The knobs of every placement policy and of admission, in one frozen model.

Each policy reads only its own fields (prefixed by its name) plus the shared pricing models
(``prefill_cost``, ``transfer``, ``decode_cost``) and the block geometry; admission reads the SLOs.
``ConductorConfig.tuning`` composes it into the cluster config.
"""

from __future__ import annotations

import logging
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from conductor.cost_model import DecodeCostModel, PrefillCostModel, TransferModel

log = logging.getLogger(__name__)

_warned_short_prefill_tokens = False



TBT_ERROR_FRAC_CAP = 0.5
"""The most admission's inter-token margin may be: a model off by more than half is re-fitted
long before it should shut admission."""

class PolicyConfig(BaseModel):
    """Knobs of every policy; each policy reads only its own (prefixed by its name)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    block_size_tokens: int = Field(16, gt=0, description="Tokens per KV block (tokens).")
    kv_bytes_per_token: int = Field(
        23_040, gt=0, description="KV bytes one token occupies (bytes); see cost_model.kv_bytes_per_token."
    )
    prefill_cost: PrefillCostModel = Field(PrefillCostModel(), description="Predicted prefill time.")
    transfer: TransferModel = Field(TransferModel(), description="Predicted KV transfer time per path.")
    sglang_cache_threshold: float = Field(
        0.3, ge=0, le=1, description="SGLang: min matched fraction of the prompt to follow the cache."
    )
    sglang_balance_abs_threshold: int = Field(
        64, ge=0, description="SGLang: imbalanced when max - min load exceeds this (requests)."
    )
    sglang_balance_rel_threshold: float = Field(
        1.5, ge=1, description="SGLang: ... and max load exceeds this × min load (ratio)."
    )
    sglang_max_tree_size_tokens: int = Field(
        2**24, ge=0, description="SGLang: each worker's approximate tree is cut back to this at every "
        "eviction (its max_tree_size, 2**26 characters, at ~4 characters a token) (tokens)."
    )
    sglang_eviction_interval_s: float = Field(
        120.0, gt=0, description="SGLang: seconds between evictions of the approximate trees "
        "(eviction_interval_secs)."
    )
    dynamo_overlap_score_weight: float = Field(
        1.0, ge=0, description="Dynamo: weight of prefill_blocks against decode_blocks."
    )
    dynamo_temperature: float = Field(
        0.0, ge=0, description="Dynamo: softmax temperature over normalized cost; 0 is argmin."
    )
    dynamo_host_hit_credit: float = Field(
        0.75, ge=0, le=1, description="Dynamo: a host-tier hit counts as this fraction of a device hit."
    )
    dynamo_disk_hit_credit: float = Field(
        0.0, ge=0, le=1, description="Dynamo: a disk-tier hit counts as this fraction of a device hit."
    )
    mooncake_kvcache_balancing_threshold: float = Field(
        2.0, gt=0, description="Mooncake: pull the best prefix when best_len / local_len exceeds this."
    )
    baton_replication_margin_frac: float = Field(
        0.05, ge=0, description="Baton: keep a local-prefix choice unless a pull is faster by more "
        "than this fraction of its TTFT (avoids replicating a prefix for a marginal gain)."
    )
    baton_colocation: Literal["priced", "short"] = Field(
        "priced", description="Baton: where a prompt prefills. 'priced': every ready decode "
        "instance is a prefill candidate priced like the prefill pool's (plus the steps its running "
        "decode batch adds), against the cheapest disaggregated option plus its KV hand-off; the "
        "least total wins. 'short': the older rule, an uncached suffix shorter than "
        "short_prefill_tokens prefills on the decode instance chosen by load."
    )
    baton_prefill_chunk_tokens: int = Field(
        2048, gt=0, description="Baton: the prompt tokens an engine prefills per step beside its "
        "running decodes (vLLM's max_num_batched_tokens with chunked prefill; 2048 is its default "
        "for engines built from EngineArgs, SchedulerConfig.DEFAULT_MAX_NUM_BATCHED_TOKENS; a live "
        "cluster sets it to its decode engines' budget, engine.max_num_batched_tokens) (tokens)."
    )
    baton_decode_stall_weight: float = Field(
        0.0, ge=0, description="Baton, co-located: the sequences on a decode instance (running, "
        "or queued before the prompt) each wait for a prompt's prefill steps there; a co-located "
        "option is priced its TTFT plus this times their number times its prefill (ms), so a "
        "prompt goes where it stalls fewer streams unless its own TTFT says otherwise. 0: TTFT "
        "only."
    )
    handoff_overhead_ms: float = Field(
        0.0, ge=0, description="Baton: what a disaggregated request's KV hand-off costs beyond "
        "moving its bytes (ms): the decode instance's store lookup and load, the step boundaries "
        "it waits for, its first step beside the running batch, and the calls between. The live "
        "conductor sets it to the median it measures (the router's time from a prefill's result "
        "to the decode's first token, less the priced transfer); 0 where nothing measures it "
        "(the simulator, or calibrate_cost_model false)."
    )
    prompts_at_once: int = Field(
        0, ge=0, description="Prompts each decode engine computes at once (its prefill gate, "
        "engine.max_prefills_in_flight as the engines run it; 0: vLLM packs every waiting prompt "
        "into its steps). With 1, a prompt queued on an engine behind a prefill of its blocks "
        "starts once those blocks are computed there, so the conductor may queue a request that "
        "coalesces right behind that prefill (ConductorConfig.coalesce_in_queue). Set by the "
        "cluster from the engine config."
    )
    short_prefill_tokens: int = Field(
        256, ge=0, description="Baton, baton_colocation 'short' only: an uncached suffix shorter "
        "than this prefills on the decode instance (tokens); 0 always disaggregates. Deprecated: "
        "setting it selects 'short' whatever baton_colocation says."
    )
    ttft_slo_ms: float | None = Field(
        None, gt=0, description="Reject when the chosen placement's predicted TTFT exceeds this "
        "(ms); unset: never reject."
    )
    tbt_slo_ms: float | None = Field(
        None, gt=0, description="Reject when the chosen decode instance's predicted inter-token time "
        "with this request exceeds this (ms); unset: never reject."
    )
    decode_cost: DecodeCostModel = Field(DecodeCostModel(), description="Predicted decode step time.")
    tbt_error_frac: float = Field(
        0.0, ge=0, le=TBT_ERROR_FRAC_CAP, description="Admission's margin on the predicted "
        "inter-token time: a request is rejected when the prediction times (1 + this) exceeds "
        "tbt_slo_ms. The live conductor sets it to its decode model's measured p90 error on steps "
        "it was not fitted on (capped); 0 where there is no calibration (the simulator)."
    )
    min_retry_after_s: float = Field(1.0, ge=0, description="Least retry-after hint on rejection (s).")

    @property
    def baton_colocation_mode(self) -> Literal["priced", "short"]:
        """The colocation rule Baton applies: ``baton_colocation``, except that a config which
        sets ``short_prefill_tokens`` keeps the old rule ('short'), whatever else sets
        ``baton_colocation`` (deploy/local.yaml does; an override of the old key still wins)."""
        if "short_prefill_tokens" in self.model_fields_set:
            return "short"
        return self.baton_colocation

    @model_validator(mode="after")
    def _warn_short_prefill_tokens(self) -> "PolicyConfig":
        global _warned_short_prefill_tokens
        if ("short_prefill_tokens" in self.model_fields_set and self.baton_colocation != "short"
                and not _warned_short_prefill_tokens):
            _warned_short_prefill_tokens = True
            log.warning("short_prefill_tokens is deprecated: setting it keeps Baton's old colocation "
                        "rule; say so with baton_colocation: short, or drop short_prefill_tokens for "
                        "baton_colocation: priced (the default)")
        return self
