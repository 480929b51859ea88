"""The conductor's config model: the placement policy, its knobs and SLOs, the cost profile,
coalescing."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field, field_validator

from conductor.policy import POLICIES, PolicyConfig


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
    calibrate_cost_model: bool = Field(
        True, description="Refit the prefill cost model online from the engines' own prefill "
        "times (vLLM's request stats: scheduled to first token), starting from the profile's fit "
        "or, without one, the placeholders (the first refit, after 8 prefills, is the warm-up); "
        "its error on prefills it was not fitted on shows in `baton status` and as "
        "baton_cost_model_error_pct (conductor.calibration)."
    )
    coalesce: bool = Field(
        True, description="Requests sharing a prefix that is being prefilled right now wait for it "
        "instead of computing it again, when waiting, the queue behind it and the rest of the "
        "prompt are priced faster than placing the request now."
    )
    coalesce_min_blocks: int = Field(
        4, ge=1, description="Wait only when at least this many of the request's blocks are being "
        "computed by one in-flight prefill (blocks)."
    )
    coalesce_elsewhere: bool = Field(
        True, description="When the prefill a request waited for ends and the instance that "
        "computed it has other waiters queued already, wait (at most that queue) for its blocks "
        "to reach the node's store, so the request may load them on another instance instead "
        "of queueing there: without it a burst sharing a new prefix all lands on one instance. "
        "Only for engines that save their prompts (prefill engines; decode engines unless "
        "engine.decode_saves is none)."
    )
    coalesce_in_queue: bool = Field(
        True, description="A request that coalesces onto a prefill running on a decode engine "
        "that computes one prompt at a time (engine.max_prefills_in_flight 1, the CPU default) "
        "is placed on that engine at once, queued right behind the prefill: the engine's gate "
        "starts it when the prefill's blocks are computed, and it keeps its place in the "
        "queue. false: it waits in the conductor for the prefill to end and is placed then, "
        "behind whatever was placed there meanwhile (on an agent fleet's fan-out a follower "
        "priced at 2.1 s took 7.0 s that way)."
    )
    coalesce_duplicate_weight: float = Field(
        0.0, ge=0, description="How much the work a request would compute twice counts against "
        "placing it now rather than coalescing: placing now is priced its TTFT plus this times "
        "(its prefill there less the rest it would prefill after coalescing), the time later "
        "requests on that instance would wait for the duplicate. 0: each request's own TTFT only."
    )
    coalesce_max_wait_ms: float = Field(
        10_000.0, gt=0, description="Longest a request waits for that prefill before placing "
        "without it (ms)."
    )

    session_prefetch: bool = Field(
        True, description="Shortly before an agent session's expected next step (the client's "
        "expected_next_step_s, else its median past pause), bring its blocks back from disk to "
        "host memory on the node its last step ran on."
    )
    session_prefetch_lead_s: float = Field(
        1.0, ge=0, description="How long before the expected next step the prefetch starts (s)."
    )

    @field_validator("policy")
    @classmethod
    def _known_policy(cls, value: str) -> str:
        if value not in POLICIES:
            raise ValueError(f"unknown policy '{value}'; choose one of {sorted(POLICIES)}")
        return value
