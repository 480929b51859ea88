"""Typed messages that cross process boundaries between the gateway, conductor and workers.

Everything that travels through a Ray call is one of these ``msgspec.Struct``s: small, typed,
cheap to serialise, and never a raw dict.
"""

from __future__ import annotations

import ipaddress

import msgspec


class SamplingOptions(msgspec.Struct, frozen=True):
    """What the client asked for; validated by the gateway before any worker sees it."""

    max_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False
    num_logprobs: int | None = None
    """Log-probabilities of each generated token and of its ``num_logprobs`` most likely
    alternatives (vLLM's ``SamplingParams.logprobs``); None: none are computed."""
    json_schema: str = ""
    """A JSON Schema (JSON text of an object) the output must satisfy, enforced by vLLM's
    structured-output backend; '' for none."""
    json_object: bool = False
    """The output must be one JSON object (any keys); exclusive with ``json_schema``."""
    top_k: int = 0
    """Sample among the ``top_k`` most likely tokens; 0: all of them."""
    min_p: float = 0.0
    """Drop tokens less likely than ``min_p`` times the most likely one; 0: none."""
    presence_penalty: float = 0.0
    """Subtracted from the logit of every token already in the output (OpenAI's, in [-2, 2])."""
    frequency_penalty: float = 0.0
    """Subtracted from a token's logit once per time it is already in the output ([-2, 2])."""
    repetition_penalty: float = 1.0
    """vLLM's multiplicative penalty on tokens in the prompt or output (> 0; 1: none)."""
    min_tokens: int = 0
    """End-of-sequence and stop tokens are held back until this many tokens are out."""
    logit_bias: tuple[tuple[int, float], ...] = ()
    """(token id, bias) pairs added to those tokens' logits before sampling."""
    regex: str = ""
    """A regular expression the whole output must match ('' for none); exclusive with the other
    constraints."""
    choice: tuple[str, ...] = ()
    """The output is exactly one of these strings (() for none); exclusive with the others."""
    num_prompt_logprobs: int | None = None
    """Log-probabilities of every prompt token but the first and of its ``num_prompt_logprobs``
    most likely alternatives (vLLM's ``SamplingParams.prompt_logprobs``); None: none. Such a
    prompt is computed whole where it is decoded: no prefix is reused (the logits of a reused
    token were never computed) and it is never prefilled apart (``PlacementRequest.colocate``)."""

    def constrained(self) -> bool:
        """The output is held to a grammar (structured outputs)."""
        return bool(self.json_schema) or self.json_object or bool(self.regex) or bool(self.choice)


class PromptBlocks(msgspec.Struct, frozen=True):
    """A prompt's block identity, hashed once at the gateway (``kvstore.keys.prompt_block_keys``)
    and carried with the request to the workers and into their engines' connectors (vLLM's
    per-request ``kv_transfer_params``), which use it instead of hashing the prompt again."""

    model_id: str
    kv_layout: str
    """The key scheme the keys were made under (``kvstore.keys.KeyExtras``; the layout tag names
    the dtype and the block size). A connector whose own scheme differs hashes the prompt itself."""
    keys: bytes
    """``kvstore.keys.pack_keys`` of the prompt's keys: 16 bytes each, every full block, then the
    partial tail block if the prompt does not end on a block boundary."""
    block_size_tokens: int
    num_full_blocks: int
    """Of those, the full blocks (the rest, 0 or 1, is the tail)."""


class Lease(msgspec.Struct, frozen=True):
    """Retention a request asks of the KV store for its prompt's leading blocks: a session step
    (``lease_id`` "s-..."), or a ``cache_control`` breakpoint ("c-..."). The store keeps leased
    blocks past plain LRU blocks within a tier (below operator soft pins), demotes them host →
    disk rather than dropping them, and carries the lease along when the blocks are pulled to
    another node. Naming a lease again replaces its blocks and renews its TTL."""

    lease_id: str
    """Scoped already: a session's id is hashed with its caller's API key and tenant."""
    tenant: str
    """Whose cap the leased bytes count against (the request's cache salt; '' is the public one)."""
    ttl_s: float
    """Seconds the lease lives without being named again."""
    num_tokens: int
    """The leased prefix: prompt tokens ``[0, num_tokens)``; its whole blocks are leased."""
    include_output: bool = False
    """Also the blocks the reply completes (a session's next step extends them)."""


class EngineRequest(msgspec.Struct, frozen=True):
    """One tokenized request as the workers see it."""

    request_id: str
    prompt_token_ids: tuple[int, ...]
    sampling: SamplingOptions
    cache_salt: str = ""
    kv_source_node: str = ""
    """The store node holding this prompt's KV when it may not be the worker's own (for a decode:
    the prefill's node; for a prefill: the node of the instance it pulls a prefix from). A worker
    on another node pulls those blocks into its own store before the engine sees the request."""
    blocks: PromptBlocks | None = None
    """The prompt's block keys, hashed at the gateway (None: whoever needs them hashes)."""
    kv_source_blocks: int | None = None
    """How many of the prompt's leading blocks to pull from ``kv_source_node``: with it, the
    transfer plan the worker's store executes (for a prefill: the placement's
    ``expected_cached_blocks``). None: every prompt block (a decode after a prefill elsewhere)."""
    store_lookup: bool = True
    """False: the placement expects no block of the prompt to be cached anywhere it can reach,
    so the engine's connector does not ask the store (one round trip less per prefill)."""
    cache_salt_offset: int = 0
    """Token offset from which ``cache_salt`` applies to the store's and the index's keys (the
    blocks wholly before it are keyed unsalted: a public trunk shared across tenants); 0: the
    whole prompt. vLLM's own prefix cache keeps the whole-prompt salt."""
    leases: tuple[Lease, ...] = ()
    """Retention asked for this prompt's blocks (session step, cache breakpoints)."""
    session_id: str = ""
    """The scoped session id ("s-..." , '' for none): the conductor's session table key."""
    expected_next_step_s: float = 0.0
    """The client's estimate of the seconds until the session's next step; 0: unknown."""
    store_save: bool = True
    """False: the engine's connector writes none of this request's blocks to the store (an
    engine's own warm-up prompts, random tokens no request will ask for)."""
    computes_prompt: bool = True
    """False: a decode whose prompt KV another instance computed (it is loaded, not computed
    here), so the engine's prefill gate does not hold it (``engine.max_prefills_in_flight``)."""
    predicted_prefill_ms: float = 0.0
    """The conductor's priced prefill of the prompt's uncached part on the instance computing it
    (``Placement.prefill_ms``; 0: not priced). With ``engine.prefill_gate_order:
    shortest_first`` the prefill gate admits held prompts by arrival plus this, so a short prompt
    passes a long one that arrived less than the long one's prefill before it (no prompt is
    passed indefinitely); with ``arrival`` (the default) it is not read."""


class PlacementRequest(msgspec.Struct, frozen=True):
    """One request as the conductor prices it (the live router's question; ``Placement`` is the
    answer)."""

    request_id: str
    num_prompt_tokens: int
    block_keys: tuple[bytes, ...] = ()
    """The prompt's chain-hashed full-block keys, in order (what ``prefix_hits`` was matched on)."""
    max_tokens: int = 0
    """Most tokens the request may generate (sizes its decode KV for admission)."""
    session_id: str = ""
    """The scoped session this request is a step of ('' for none)."""
    expected_next_step_s: float = 0.0
    """The client's estimate of the seconds until the session's next step; 0: unknown."""
    session_ttl_s: float = 0.0
    """Seconds the session lives without a step (its lease's TTL); 0: the conductor's default."""
    segmented_salt: bool = False
    """The keys are segmented (``EngineRequest.cache_salt_offset``): the engine's own cache holds
    the prompt's blocks under whole-prompt-salted keys, not these, so a finished prefill does not
    make these keys device blocks of its instance (its KV events say what it holds)."""
    colocate: bool = False
    """The prompt must be computed on the decode instance that decodes it (its prompt's
    log-probabilities are asked for: ``SamplingOptions.num_prompt_logprobs``), whatever the
    policy would choose."""


class Placement(msgspec.Struct, frozen=True):
    """Where a request runs: the conductor's answer for one request."""

    prefill_instance: str
    decode_instance: str
    policy: str
    reason: str = ""
    transfer_ms: float = 0.0
    """Priced KV transfer time for the chosen prefill instance (ms); see conductor.policy.price."""
    queue_ms: float = 0.0
    """Priced wait behind the prefills already queued there (ms)."""
    prefill_ms: float = 0.0
    """Priced prefill time of the uncached suffix (ms)."""
    expected_cached_blocks: int = 0
    """Prompt blocks the index says the prefill instance can reuse (local or pulled)."""
    pulled_from: str = ""
    """The instance whose prefix is pulled ('' when the local prefix is used)."""
    pulled_from_node: str = ""
    """... and the store node it runs on."""
    priority: int = 0
    """Queue position within the prefill instance: lower runs first (longest prefix first)."""
    handoff_ms: float = 0.0
    """Priced KV hand-off to the decode instance (ms; its calibrated overhead included), when the
    policy prices one (Baton, disaggregated); 0 otherwise."""
    decode_batch_ms: float = 0.0
    """Of ``queue_ms``, the decode steps of the instance's running batch that the prompt's chunks
    share (a co-located prefill beside a batch; 0 otherwise): the prefill's own steps take that
    much longer, which the cost model's calibration takes out of the measured prefill."""
    device_blocks: int = -1
    """Of ``expected_cached_blocks``, those the index says the prefill instance holds in its own
    device cache (or will, once the prefill it queues behind is done); -1: not known (not
    co-located, or pulled). When they are all of them, the node's store holds no more of the
    prompt and the engine skips its store lookup (a round trip that answered nothing, and on a
    stepping engine cost the request a step)."""


class CachedByTier(msgspec.Struct, frozen=True):
    """A request's reused prompt tokens (the ones not computed) by where their KV came from;
    the four add up to its ``cached_tokens``."""

    device: int = 0
    """Found in the computing engine's own prefix cache (device memory)."""
    host: int = 0
    """Loaded from its node's KV store host tier (DRAM)."""
    disk: int = 0
    """Loaded from its node's store after the store brought them back from its disk tier."""
    pulled: int = 0
    """Pulled from another node's store before the prefill, then loaded."""

    @property
    def total(self) -> int:
        return self.device + self.host + self.disk + self.pulled


class PrefillResult(msgspec.Struct, frozen=True):
    """What the prefill worker reports once the prompt's KV is in the store."""

    request_id: str
    instance_id: str
    num_prompt_tokens: int
    num_cached_tokens: int
    num_stored_blocks: int
    prefill_ms: float
    num_loaded_tokens: int = 0
    """Of ``num_cached_tokens``, those loaded from the KV store (host tier) rather than found in
    the engine's own device cache."""
    node_id: str = ""
    """The store node now holding the prompt's blocks (the prefill instance's node)."""
    num_pulled_blocks: int = 0
    """Blocks pulled from another node's store before the prefill (``kv_source_node``)."""
    engine_prefill_ms: float | None = None
    """The engine's own prefill time: from first scheduled to its first token (vLLM's request
    stats), without the queue, pulls and saves ``prefill_ms`` includes; None: not measured."""
    cached_by_tier: CachedByTier | None = None
    """``num_cached_tokens`` by tier; None from a worker that does not break it down."""


class TokenLogprob(msgspec.Struct, frozen=True):
    """One token's log-probability as the engine's sampler computed it (vLLM's raw
    log-probabilities, before temperature and top-p)."""

    token_id: int
    token: str
    """The token's text on its own (vLLM's ``decoded_token``)."""
    logprob: float
    rank: int
    """1 for the most likely token of its position."""


class PositionLogprobs(msgspec.Struct, frozen=True):
    """One generated position: the chosen token and the most likely ones, best first."""

    chosen: TokenLogprob
    top: tuple[TokenLogprob, ...] = ()
    """The ``SamplingOptions.num_logprobs`` most likely tokens, by rank (the chosen one among
    them when it ranks that high)."""


class EnginePrefill(msgspec.Struct, frozen=True):
    """A prefill the decode engine ran itself (co-located), as it measured it."""

    num_cached_tokens: int
    """Prompt tokens it did not compute (its prefix cache plus loaded KV)."""
    prefill_ms: float
    """From first scheduled to the first token (vLLM's request stats; no queue wait)."""


class TokenChunk(msgspec.Struct, frozen=True):
    """A slice of the decode stream: new token ids and their text delta.

    The last chunk of a request has ``finish_reason`` set and carries the decode side's
    ``num_loaded_tokens`` (prompt tokens whose KV was loaded from the store, not recomputed).
    """

    token_ids: tuple[int, ...]
    text: str
    finish_reason: str | None = None
    num_loaded_tokens: int = 0
    num_cached_tokens: int = 0
    """Prompt tokens the decode engine did not compute (its prefix cache plus loaded KV)."""
    num_pulled_blocks: int = 0
    """Prompt blocks the decode worker pulled from another node's store (last chunk only)."""
    logprobs: tuple[PositionLogprobs, ...] = ()
    """One per token of ``token_ids`` when the request asked for them
    (``SamplingOptions.num_logprobs``); empty otherwise."""
    stop_sequence: str = ""
    """The stop string (one of ``SamplingOptions.stop``) whose match ended the request; '' when
    none did (end of sequence, length, no stop strings). Last chunk only."""
    engine_prefill: EnginePrefill | None = None
    """The first chunk with tokens: the engine's own measure of the prefill it ran (None where
    it was not measured)."""
    cached_by_tier: CachedByTier | None = None
    """Last chunk: ``num_cached_tokens`` by tier (None: not broken down)."""
    prompt_logprobs: tuple[PositionLogprobs, ...] = ()
    """First chunk of a request with ``SamplingOptions.num_prompt_logprobs``: one per prompt
    token from the second on (the first has none); empty otherwise."""


class DecodeStep(msgspec.Struct, frozen=True, array_like=True):
    """One engine step that only decoded, as the engine's thread timed it."""

    num_seqs: int
    context_tokens: int
    """Tokens the batch attended over (every sequence's computed tokens)."""
    step_ms: float
    seq: int = -1
    """The step's number among the engine's timed steps with sequences decoding in them
    (decode-only ones and ``MixedStep``s share the count; from 0; -1: not numbered):
    ``DecodeSpan``s name steps by it."""


class PromptChunk(msgspec.Struct, frozen=True, array_like=True):
    """Part of one prompt computed in one engine step (chunked prefill)."""

    done_tokens: int
    """Of the prompt's uncached tokens, those computed in earlier steps."""
    num_tokens: int
    """Computed in this step."""
    cached_tokens: int
    """The prompt's tokens it did not compute (its prefix hit when it was first scheduled)."""


class MixedStep(msgspec.Struct, frozen=True, array_like=True):
    """One engine step that decoded ``num_seqs`` sequences while it computed prompt chunks (a
    co-located engine), as the engine's thread timed it. Placement prices such a step as the
    decode batch's step plus each chunk's share of its prompt's prefill; the conductor judges
    that price on it (``CostCalibration.observe_mixed_step``), never fits on it."""

    num_seqs: int
    context_tokens: int
    """Tokens the decoding sequences attended over."""
    chunks: tuple[PromptChunk, ...]
    step_ms: float
    seq: int
    """Its number in the count ``DecodeStep.seq`` shares."""
    loaded_blocks: int = 0
    """KV blocks the connector copied in on the step, before its forward pass (a hand-off's
    blocks, when cheap enough to copy there): their copy is part of ``step_ms``."""


class DecodeSpan(msgspec.Struct, frozen=True, array_like=True):
    """A finished request's decode-only steps: every one the engine timed from ``first_seq`` to
    ``last_seq`` (``DecodeStep.seq``) had it in its batch. The conductor judges its decode-step
    model per request over them (``CostCalibration.observe_decode_span``)."""

    first_seq: int
    last_seq: int
    """(Since ``MixedStep``s share the numbering, the steps of a span are decode-only and mixed
    ones; each figure judges the kind it covers.)"""


class InstanceStats(msgspec.Struct, frozen=True):
    """A worker's load, as the conductor's snapshot holds it."""

    instance_id: str
    role: str
    num_running_reqs: int
    num_waiting_reqs: int
    num_finished_reqs: int
    ready: bool
    kv_usage_frac: float = 0.0
    """Fraction of the engine's KV cache in use, 0..1."""
    kv_loaded_bytes: int = 0
    """KV bytes the engine's connector has loaded from the node's store, since start."""
    kv_load_seconds: float = 0.0
    """... and the seconds those loads took: the measured same-node transfer bandwidth."""
    node_id: str = ""
    """The KV store node (machine) the instance runs on."""
    num_prompt_tokens: int = 0
    """Prompt tokens this instance has processed (prefix-cache queries, in tokens)."""
    num_cached_tokens: int = 0
    """Of those, tokens it did not compute (prefix-cache hits: device cache or store)."""
    recent_ttft_ms: float | None = None
    """Median time to first token over its recent requests, as the instance sees it (ms)."""
    recent_itl_ms: float | None = None
    """Median inter-token latency over its recent requests (decode instances; ms)."""
    decode_steps: tuple[DecodeStep, ...] = ()
    """Decode-only engine steps timed since the previous ``stats`` call (the newest few): what
    the conductor refits its decode-step model from."""
    decode_spans: tuple[DecodeSpan, ...] = ()
    """Requests finished since the previous ``stats`` call: the timed steps each decoded in."""
    mixed_steps: tuple[MixedStep, ...] = ()
    """Steps that decoded beside prompt chunks, timed since the previous ``stats`` call (the
    newest few): the conductor judges their price, and with them a request's whole decode."""


# ---------------------------------------------------------------- operations (pools, fronts)


class ScaleResult(msgspec.Struct, frozen=True):
    role: str
    size_before: int
    size_after: int
    added: list[str]
    removed: list[str]
    pending: list[str]
    """Added instances not ready when the call returned (waiting for a node or their engine);
    they join when ready."""
    failed: list[str]
    """Added instances whose engine failed to start (removed again), with the error."""


class DrainResult(msgspec.Struct, frozen=True):
    instance_id: str
    drained_requests: int
    """Requests that were booked on it when the drain began (all finished before it left)."""
    drain_s: float


class InstanceRow(msgspec.Struct, frozen=True):
    """One line of ``baton status``."""

    instance_id: str
    role: str
    node_id: str
    phase: str
    """starting | ready | draining | not_ready (stopped answering or engine dead)."""
    num_waiting_reqs: int
    num_running_reqs: int
    num_booked_reqs: int
    """Requests the conductor placed there and has not heard the end of."""
    kv_usage_frac: float
    num_prompt_tokens: int
    num_cached_tokens: int
    recent_ttft_ms: float | None
    recent_itl_ms: float | None
    kv_load_seconds: float = 0.0
    """Seconds the instance's connector has spent loading KV from its node's store, since start."""


class StoreRow(msgspec.Struct, frozen=True):
    node_id: str
    host_capacity_blocks: int
    host_used_blocks: int
    host_pinned_blocks: int
    disk_used_blocks: int
    evicted_blocks: int
    counters: TierCounters
    """Everything ``KVStoreNode.tier_counters`` reports: full-arena and full-disk rejections,
    disk write errors, corrupt blocks, promotions, demotions, pulls."""


class PoolDecision(msgspec.Struct, frozen=True):
    """One decision of the autoscaling planner (``conductor.planner.plan``) for one pool."""

    pool: str
    """prefill | decode."""
    action: str
    """up | down | hold."""
    size_before: int
    """Instances in the pool that are not leaving (starting or ready) when it decided."""
    size_after: int
    """The size it asks for (``size_before`` when it holds)."""
    reason: str
    """The rule that fired, with its numbers (``TTFT 3400.0 ms > 1.00 x 3000.0 ms``)."""
    at_s: float = 0.0
    """Wall-clock time of the decision (Unix seconds)."""
    outcome: str = ""
    """For a change (up or down): ``under way``, ``done`` (the pool reached ``size_after``),
    ``pending: ...`` (instances still waiting for a node or their engine) or ``failed: ...``
    (nothing changed, with the error). Empty for a hold."""


class AutoscaleStatus(msgspec.Struct, frozen=True):
    """The planner as ``baton status`` shows it."""

    enabled: bool
    """Whether the loop applies its decisions (off: it still decides and reports)."""
    last: list[PoolDecision]
    """The latest decision for each pool, prefill first."""
    changes: list[PoolDecision]
    """The decisions that changed a pool (up or down), oldest first, the last 50."""
    decisions_total: dict[str, int]
    """``pool/action`` → decisions made since the conductor started."""


class PredictionError(msgspec.Struct, frozen=True):
    """Absolute percentage errors of predictions made before fitting on what they predicted."""

    median_pct: float
    p90_pct: float
    num_predictions: int
    """How many predictions the figures are over (the last ``error_window`` at most)."""


class CostModelStatus(msgspec.Struct, frozen=True):
    """The conductor's cost model as it prices now: whether it refits itself from the engines'
    measured timings, and its error on requests it was not fitted on (None: nothing measured)."""

    calibrating: bool
    prefill: PredictionError | None = None
    decode: PredictionError | None = None
    prefill_source: str = ""
    """Where the prefill model's figures come from: 'profile', 'placeholders', 'warm-up of N
    prefills' or 'refit N times on live prefills' ('' from a conductor that does not say)."""
    handoff_overhead_ms: float = 0.0
    """The measured overhead of a disaggregated KV hand-off the conductor prices now (ms;
    ``PolicyConfig.handoff_overhead_ms``)."""
    handoff: PredictionError | None = None
    """The priced hand-off's error on hand-offs measured after it was set."""
    decode_per_request: PredictionError | None = None
    """The decode-step model's error per finished request: its decode-only steps' predicted
    time (each predicted before it was fitted) against their measured time, summed."""
    mixed_step: PredictionError | None = None
    """The price of a step that decoded beside prompt chunks (decode step + the chunks' share
    of their prompts' prefill, as placement prices a co-located prefill's batch) against its
    measured time."""
    decode_per_request_all_steps: PredictionError | None = None
    """Per finished request over every timed step it decoded in, decode-only and mixed: the
    cost model's price of its whole decode against its measured time, summed."""


class PoolStatus(msgspec.Struct, frozen=True):
    policy: str
    pool_sizes: dict[str, dict[str, int]]
    """pool → phase → instances."""
    instances: list[InstanceRow]
    stores: list[StoreRow]
    counters: object
    """``conductor.state.PlacementCounters``."""
    recent_events: list[str]
    autoscale: AutoscaleStatus | None = None
    """The autoscaling planner's last decisions; None on a cluster that cannot resize itself
    (``baton serve``)."""
    cost_model: CostModelStatus | None = None
    """The cost model's calibration and held-out error; None from a conductor older than it."""


class FrontAddresses(msgspec.Struct, frozen=True):
    host_ip: str
    grpc_port: int | None
    http_port: int | None
    http_tls: bool = False
    """The HTTP front serves HTTPS (``http.tls_cert_file``)."""
    grpc_host: str = ""
    """The address the gRPC front listens on (``gateway.host``; '0.0.0.0': every interface);
    '' when unknown (a gateway older than this field)."""
    http_host: str = ""
    """The address the HTTP front listens on (``http.host``)."""

    def reachable(self, bound: str) -> str:
        """The address a client should dial for a front bound to ``bound``: the node's own
        address for every interface (or unknown), else the bound address itself."""
        return self.host_ip if bound in ("", "0.0.0.0", "::") else bound

    def loopback_only(self) -> list[str]:
        """The fronts (``gRPC``, ``HTTP``) that listen on a loopback address only."""

        def loopback(host: str) -> bool:
            if host == "localhost":
                return True
            try:
                return ipaddress.ip_address(host).is_loopback
            except ValueError:
                return False

        fronts = [("gRPC", self.grpc_port, self.grpc_host), ("HTTP", self.http_port, self.http_host)]
        return [name for name, port, host in fronts if port is not None and loopback(host)]


# ---------------------------------------------------------------- actor calls (no raw dicts)


class MeasuredPrefill(msgspec.Struct, frozen=True):
    """One prefill an engine timed: its uncached and cached prompt tokens and the engine's own
    prefill time (scheduled to first token), in ms."""

    uncached_tokens: int
    cached_tokens: int
    prefill_ms: float


class Registration(msgspec.Struct, frozen=True):
    """An engine instance joining the conductor once its engine is up (``Conductor.register``)."""

    instance_id: str
    role: str
    """prefill | decode."""
    node_id: str
    """The store node it runs on ('' without a store)."""
    model_id: str
    kv_layout: str
    """Its KV key layout tag (``kvstore.keys.kv_layout_tag``: dtype and block size)."""
    replay_endpoint: str = ""
    """Where its engine's KV-event replay buffer answers ('' without one)."""
    warmup_prefills: tuple[MeasuredPrefill, ...] = ()
    """The prefills its warm-up timed (``engine.warmup``; empty with ``engine.warm_up`` off):
    the conductor's cost model fits from them when no profile was given."""
    saves_prompts: bool = False
    """Its engine saves the prompts it computes to its node's store (a prefill engine always, a
    decode engine unless ``engine.decode_saves`` is ``none``): requests coalescing on one of its
    prefills may then load the blocks on another instance of that node."""


class PoolSizes(msgspec.Struct, frozen=True):
    """The pool sizes a ``scale`` asks for (instances); None leaves that pool as it is."""

    prefill: int | None = None
    decode: int | None = None

    def requested(self) -> list[tuple[str, int]]:
        """(pool, size) of each pool given, prefill first."""
        return [(pool, size) for pool, size in (("prefill", self.prefill), ("decode", self.decode))
                if size is not None]


class TierCounters(msgspec.Struct, frozen=True, omit_defaults=True):
    """What ``KVStoreNode.tier_counters`` reports: blocks moved between the node's tiers, host
    rejections and soft pins, pulls from other nodes, and the disk tier's own counters.

    The ``disk_*`` fields are None on a node without a disk tier and are then left out of the
    encoded form (``baton status --json``, the Admin proto's ``counters`` map, ``as_dict``)."""

    promoted_blocks: int
    """Blocks copied up from disk into host memory."""
    demoted_blocks: int
    """Blocks written down to disk when host memory evicted them."""
    host_full_rejected_blocks: int
    """Blocks a writer could not store: host memory was full of pinned blocks."""
    soft_pinned_blocks: int
    """Blocks of operator-pinned prefixes in host memory now (a level, not a count of events)."""
    pulled_blocks: int
    pulled_bytes: int
    pull_failures: int
    """Pulls from another node that failed (that node gone, Redis down, a transfer error)."""
    disk_blocks: int | None = None
    """Blocks on disk now (a level)."""
    disk_hits: int | None = None
    disk_corrupt_blocks: int | None = None
    """Disk blocks that failed their checksum (deleted, served as misses)."""
    disk_evictions: int | None = None
    disk_write_errors: int | None = None
    disk_rejected_puts: int | None = None
    """Blocks the disk tier refused: no room could be made for them."""
    leased_blocks: int | None = None
    """Blocks in the node's tiers that a live session or cache_control lease names (a level;
    None from a node older than leases)."""
    leased_bytes: int | None = None
    """... in bytes (a level)."""
    lease_evictions: int | None = None
    """Leases that gave way to a cap, and leased blocks that left the node anyway."""

    def as_dict(self) -> dict[str, int]:
        """The counters present, by name, in field order: what the Admin proto's map and the
        Prometheus store series carry."""
        return {name: value for name, value in msgspec.structs.asdict(self).items()
                if value is not None}


class ClusterLoad(msgspec.Struct, frozen=True):
    """The cluster's load as the conductor knows it (``Conductor.cluster_load``): what the engine
    gRPC contract's ``GetLoads`` reports for the whole cluster."""

    instances: list[InstanceStats]
    """The last stats of every ready instance (polled every ``conductor.stats_interval_s``)."""
    num_in_flight_prefills: int
    """Requests placed whose prefill has not answered yet (the conductor's queue book)."""
    num_in_flight_decodes: int
    """Requests placed that have not finished yet."""


class KvFeedBatch(msgspec.Struct, frozen=True):
    """One engine's KV event batch as the conductor received it, under the conductor's own
    sequence number (``Conductor.kv_event_batches``)."""

    seq: int
    """1, 2, 3, ... in the order the conductor received batches from every engine."""
    instance_id: str
    """The engine that published it (its ZMQ topic)."""
    payload: bytes
    """vLLM's msgpack ``KVEventBatch``, as sent (``kvstore.events`` decodes it)."""


# ---------------------------------------------------------------- round trips


class CallCounts(msgspec.Struct):
    """Remote calls one component made, by ``target.method`` (``conductor.place``,
    ``store.acquire``, ``gcs.get_actor``): what each component counts of its own calls, so a
    test can read them back through an actor method and pin the round trips of one request.

    ``blocking``: the caller waited for the answer before going on. ``deferred``: sent without
    waiting where it was made; its answer is awaited later, off that path (a prefill's commits,
    awaited once before its result returns). ``sent``: never awaited on the request's path
    (fire-and-forget). Background polling (readiness, stats) is not counted."""

    blocking: dict[str, int] = {}
    deferred: dict[str, int] = {}
    sent: dict[str, int] = {}

    def count(self, call: str, kind: str = "blocking") -> None:
        tally: dict[str, int] = getattr(self, kind)
        tally[call] = tally.get(call, 0) + 1

    def snapshot(self) -> "CallCounts":
        return CallCounts(dict(self.blocking), dict(self.deferred), dict(self.sent))

    def plus(self, other: "CallCounts") -> "CallCounts":
        def add(a: dict[str, int], b: dict[str, int]) -> dict[str, int]:
            return {k: a.get(k, 0) + b.get(k, 0) for k in sorted(a.keys() | b.keys())}

        return CallCounts(add(self.blocking, other.blocking), add(self.deferred, other.deferred),
                          add(self.sent, other.sent))

    def since(self, earlier: "CallCounts") -> "CallCounts":
        """The calls made after ``earlier`` (a snapshot of the same counter); zeros left out."""
        def sub(a: dict[str, int], b: dict[str, int]) -> dict[str, int]:
            return {k: a[k] - b.get(k, 0) for k in sorted(a) if a[k] != b.get(k, 0)}

        return CallCounts(sub(self.blocking, earlier.blocking),
                          sub(self.deferred, earlier.deferred), sub(self.sent, earlier.sent))

    def total(self, kind: str = "blocking") -> int:
        return sum(getattr(self, kind).values())


class ConnectorCounters(msgspec.Struct, frozen=True):
    """What ``EngineWorker.connector_counters`` reports: one engine's KV connector, since start
    (blocks, unless named otherwise)."""

    lookups_blocks: int
    """Prompt blocks looked up in the store (beyond the engine's own prefix cache)."""
    hits_blocks: int
    """Of those, the blocks the store held and pinned."""
    loaded_blocks: int
    """Blocks copied from the store into the engine's KV cache."""
    saved_blocks: int
    """Blocks written into the store."""
    failed_load_blocks: int
    """Promised blocks whose store was gone by the time they were copied (recomputed)."""
    dropped_save_blocks: int
    """Blocks not saved because the store was gone."""
    loaded_bytes: int = 0
    load_seconds: float = 0.0
    """Wall time spent copying loaded blocks into the engine's KV cache (s)."""
    hashed_prompts: int = 0
    """Prompts the connector hashed itself because the request carried no block keys under its
    key scheme (engines driven directly); 0 for requests through the gateway."""


class KeyScheme(msgspec.Struct, frozen=True):
    """How the fronts must name a prompt's blocks so the index can match them."""

    model_id: str
    kv_layout: str
    block_size_tokens: int
    kv_bytes_per_token: int = 0


class SoftPin(msgspec.Struct, frozen=True):
    """An operator-pinned prefix: its name, size, and how much of it each store holds now."""

    name: str
    num_blocks: int
    num_tokens: int
    present_blocks_by_node: dict[str, int]


class SessionEnd(msgspec.Struct, frozen=True):
    """What closing a session ended (the conductor's answer to ``close_session``)."""

    session_id: str
    """The scoped id ("s-...")."""
    num_steps: int
    released_blocks: int
    """Leased blocks released on the store nodes (they are ordinary LRU blocks now)."""
