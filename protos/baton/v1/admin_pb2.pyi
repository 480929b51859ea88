from protos.baton.v1 import inference_pb2 as _inference_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class CloseSessionRequest(_message.Message):
    __slots__ = ("session_id", "tenant", "api_key")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    TENANT_FIELD_NUMBER: _ClassVar[int]
    API_KEY_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    tenant: str
    api_key: str
    def __init__(self, session_id: _Optional[str] = ..., tenant: _Optional[str] = ..., api_key: _Optional[str] = ...) -> None: ...

class SessionClosed(_message.Message):
    __slots__ = ("session_id", "num_steps", "released_blocks")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    NUM_STEPS_FIELD_NUMBER: _ClassVar[int]
    RELEASED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    num_steps: int
    released_blocks: int
    def __init__(self, session_id: _Optional[str] = ..., num_steps: _Optional[int] = ..., released_blocks: _Optional[int] = ...) -> None: ...

class SetAutoscaleRequest(_message.Message):
    __slots__ = ("enabled",)
    ENABLED_FIELD_NUMBER: _ClassVar[int]
    enabled: bool
    def __init__(self, enabled: _Optional[bool] = ...) -> None: ...

class StatusRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class StatusResponse(_message.Message):
    __slots__ = ("cluster_name", "policy", "pool_sizes", "instances", "stores", "placement_counters", "placements_by_prefill_instance", "recent_events", "fronts", "autoscale", "cost_model")
    class PoolSizesEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: PhaseCounts
        def __init__(self, key: _Optional[str] = ..., value: _Optional[_Union[PhaseCounts, _Mapping]] = ...) -> None: ...
    class PlacementCountersEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    class PlacementsByPrefillInstanceEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    CLUSTER_NAME_FIELD_NUMBER: _ClassVar[int]
    POLICY_FIELD_NUMBER: _ClassVar[int]
    POOL_SIZES_FIELD_NUMBER: _ClassVar[int]
    INSTANCES_FIELD_NUMBER: _ClassVar[int]
    STORES_FIELD_NUMBER: _ClassVar[int]
    PLACEMENT_COUNTERS_FIELD_NUMBER: _ClassVar[int]
    PLACEMENTS_BY_PREFILL_INSTANCE_FIELD_NUMBER: _ClassVar[int]
    RECENT_EVENTS_FIELD_NUMBER: _ClassVar[int]
    FRONTS_FIELD_NUMBER: _ClassVar[int]
    AUTOSCALE_FIELD_NUMBER: _ClassVar[int]
    COST_MODEL_FIELD_NUMBER: _ClassVar[int]
    cluster_name: str
    policy: str
    pool_sizes: _containers.MessageMap[str, PhaseCounts]
    instances: _containers.RepeatedCompositeFieldContainer[InstanceStatus]
    stores: _containers.RepeatedCompositeFieldContainer[StoreStatus]
    placement_counters: _containers.ScalarMap[str, int]
    placements_by_prefill_instance: _containers.ScalarMap[str, int]
    recent_events: _containers.RepeatedScalarFieldContainer[str]
    fronts: Fronts
    autoscale: AutoscaleStatus
    cost_model: CostModelStatus
    def __init__(self, cluster_name: _Optional[str] = ..., policy: _Optional[str] = ..., pool_sizes: _Optional[_Mapping[str, PhaseCounts]] = ..., instances: _Optional[_Iterable[_Union[InstanceStatus, _Mapping]]] = ..., stores: _Optional[_Iterable[_Union[StoreStatus, _Mapping]]] = ..., placement_counters: _Optional[_Mapping[str, int]] = ..., placements_by_prefill_instance: _Optional[_Mapping[str, int]] = ..., recent_events: _Optional[_Iterable[str]] = ..., fronts: _Optional[_Union[Fronts, _Mapping]] = ..., autoscale: _Optional[_Union[AutoscaleStatus, _Mapping]] = ..., cost_model: _Optional[_Union[CostModelStatus, _Mapping]] = ...) -> None: ...

class CostModelStatus(_message.Message):
    __slots__ = ("calibrating", "prefill", "decode", "prefill_source", "handoff_overhead_ms", "handoff", "decode_per_request", "mixed_step", "decode_per_request_all_steps")
    CALIBRATING_FIELD_NUMBER: _ClassVar[int]
    PREFILL_FIELD_NUMBER: _ClassVar[int]
    DECODE_FIELD_NUMBER: _ClassVar[int]
    PREFILL_SOURCE_FIELD_NUMBER: _ClassVar[int]
    HANDOFF_OVERHEAD_MS_FIELD_NUMBER: _ClassVar[int]
    HANDOFF_FIELD_NUMBER: _ClassVar[int]
    DECODE_PER_REQUEST_FIELD_NUMBER: _ClassVar[int]
    MIXED_STEP_FIELD_NUMBER: _ClassVar[int]
    DECODE_PER_REQUEST_ALL_STEPS_FIELD_NUMBER: _ClassVar[int]
    calibrating: bool
    prefill: PredictionError
    decode: PredictionError
    prefill_source: str
    handoff_overhead_ms: float
    handoff: PredictionError
    decode_per_request: PredictionError
    mixed_step: PredictionError
    decode_per_request_all_steps: PredictionError
    def __init__(self, calibrating: _Optional[bool] = ..., prefill: _Optional[_Union[PredictionError, _Mapping]] = ..., decode: _Optional[_Union[PredictionError, _Mapping]] = ..., prefill_source: _Optional[str] = ..., handoff_overhead_ms: _Optional[float] = ..., handoff: _Optional[_Union[PredictionError, _Mapping]] = ..., decode_per_request: _Optional[_Union[PredictionError, _Mapping]] = ..., mixed_step: _Optional[_Union[PredictionError, _Mapping]] = ..., decode_per_request_all_steps: _Optional[_Union[PredictionError, _Mapping]] = ...) -> None: ...

class PredictionError(_message.Message):
    __slots__ = ("median_pct", "p90_pct", "num_predictions")
    MEDIAN_PCT_FIELD_NUMBER: _ClassVar[int]
    P90_PCT_FIELD_NUMBER: _ClassVar[int]
    NUM_PREDICTIONS_FIELD_NUMBER: _ClassVar[int]
    median_pct: float
    p90_pct: float
    num_predictions: int
    def __init__(self, median_pct: _Optional[float] = ..., p90_pct: _Optional[float] = ..., num_predictions: _Optional[int] = ...) -> None: ...

class AutoscaleStatus(_message.Message):
    __slots__ = ("enabled", "last", "changes", "decisions_total")
    class DecisionsTotalEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    ENABLED_FIELD_NUMBER: _ClassVar[int]
    LAST_FIELD_NUMBER: _ClassVar[int]
    CHANGES_FIELD_NUMBER: _ClassVar[int]
    DECISIONS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    enabled: bool
    last: _containers.RepeatedCompositeFieldContainer[PoolDecision]
    changes: _containers.RepeatedCompositeFieldContainer[PoolDecision]
    decisions_total: _containers.ScalarMap[str, int]
    def __init__(self, enabled: _Optional[bool] = ..., last: _Optional[_Iterable[_Union[PoolDecision, _Mapping]]] = ..., changes: _Optional[_Iterable[_Union[PoolDecision, _Mapping]]] = ..., decisions_total: _Optional[_Mapping[str, int]] = ...) -> None: ...

class PoolDecision(_message.Message):
    __slots__ = ("pool", "action", "size_before", "size_after", "reason", "at_s", "outcome")
    POOL_FIELD_NUMBER: _ClassVar[int]
    ACTION_FIELD_NUMBER: _ClassVar[int]
    SIZE_BEFORE_FIELD_NUMBER: _ClassVar[int]
    SIZE_AFTER_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    AT_S_FIELD_NUMBER: _ClassVar[int]
    OUTCOME_FIELD_NUMBER: _ClassVar[int]
    pool: str
    action: str
    size_before: int
    size_after: int
    reason: str
    at_s: float
    outcome: str
    def __init__(self, pool: _Optional[str] = ..., action: _Optional[str] = ..., size_before: _Optional[int] = ..., size_after: _Optional[int] = ..., reason: _Optional[str] = ..., at_s: _Optional[float] = ..., outcome: _Optional[str] = ...) -> None: ...

class PhaseCounts(_message.Message):
    __slots__ = ("instances_by_phase",)
    class InstancesByPhaseEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    INSTANCES_BY_PHASE_FIELD_NUMBER: _ClassVar[int]
    instances_by_phase: _containers.ScalarMap[str, int]
    def __init__(self, instances_by_phase: _Optional[_Mapping[str, int]] = ...) -> None: ...

class InstanceStatus(_message.Message):
    __slots__ = ("instance_id", "role", "node_id", "phase", "num_waiting_reqs", "num_running_reqs", "num_booked_reqs", "kv_usage_frac", "num_prompt_tokens", "num_cached_tokens", "recent_ttft_ms", "recent_itl_ms", "kv_load_seconds")
    INSTANCE_ID_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    PHASE_FIELD_NUMBER: _ClassVar[int]
    NUM_WAITING_REQS_FIELD_NUMBER: _ClassVar[int]
    NUM_RUNNING_REQS_FIELD_NUMBER: _ClassVar[int]
    NUM_BOOKED_REQS_FIELD_NUMBER: _ClassVar[int]
    KV_USAGE_FRAC_FIELD_NUMBER: _ClassVar[int]
    NUM_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    RECENT_TTFT_MS_FIELD_NUMBER: _ClassVar[int]
    RECENT_ITL_MS_FIELD_NUMBER: _ClassVar[int]
    KV_LOAD_SECONDS_FIELD_NUMBER: _ClassVar[int]
    instance_id: str
    role: str
    node_id: str
    phase: str
    num_waiting_reqs: int
    num_running_reqs: int
    num_booked_reqs: int
    kv_usage_frac: float
    num_prompt_tokens: int
    num_cached_tokens: int
    recent_ttft_ms: float
    recent_itl_ms: float
    kv_load_seconds: float
    def __init__(self, instance_id: _Optional[str] = ..., role: _Optional[str] = ..., node_id: _Optional[str] = ..., phase: _Optional[str] = ..., num_waiting_reqs: _Optional[int] = ..., num_running_reqs: _Optional[int] = ..., num_booked_reqs: _Optional[int] = ..., kv_usage_frac: _Optional[float] = ..., num_prompt_tokens: _Optional[int] = ..., num_cached_tokens: _Optional[int] = ..., recent_ttft_ms: _Optional[float] = ..., recent_itl_ms: _Optional[float] = ..., kv_load_seconds: _Optional[float] = ...) -> None: ...

class StoreStatus(_message.Message):
    __slots__ = ("node_id", "host_capacity_blocks", "host_used_blocks", "host_pinned_blocks", "disk_used_blocks", "evicted_blocks", "counters")
    class CountersEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    HOST_CAPACITY_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    HOST_USED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    HOST_PINNED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    DISK_USED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    EVICTED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    COUNTERS_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    host_capacity_blocks: int
    host_used_blocks: int
    host_pinned_blocks: int
    disk_used_blocks: int
    evicted_blocks: int
    counters: _containers.ScalarMap[str, int]
    def __init__(self, node_id: _Optional[str] = ..., host_capacity_blocks: _Optional[int] = ..., host_used_blocks: _Optional[int] = ..., host_pinned_blocks: _Optional[int] = ..., disk_used_blocks: _Optional[int] = ..., evicted_blocks: _Optional[int] = ..., counters: _Optional[_Mapping[str, int]] = ...) -> None: ...

class Fronts(_message.Message):
    __slots__ = ("host_ip", "grpc_port", "http_port", "http_tls", "grpc_host", "http_host")
    HOST_IP_FIELD_NUMBER: _ClassVar[int]
    GRPC_PORT_FIELD_NUMBER: _ClassVar[int]
    HTTP_PORT_FIELD_NUMBER: _ClassVar[int]
    HTTP_TLS_FIELD_NUMBER: _ClassVar[int]
    GRPC_HOST_FIELD_NUMBER: _ClassVar[int]
    HTTP_HOST_FIELD_NUMBER: _ClassVar[int]
    host_ip: str
    grpc_port: int
    http_port: int
    http_tls: bool
    grpc_host: str
    http_host: str
    def __init__(self, host_ip: _Optional[str] = ..., grpc_port: _Optional[int] = ..., http_port: _Optional[int] = ..., http_tls: _Optional[bool] = ..., grpc_host: _Optional[str] = ..., http_host: _Optional[str] = ...) -> None: ...

class ScaleRequest(_message.Message):
    __slots__ = ("prefill", "decode", "timeout_s")
    PREFILL_FIELD_NUMBER: _ClassVar[int]
    DECODE_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_S_FIELD_NUMBER: _ClassVar[int]
    prefill: int
    decode: int
    timeout_s: float
    def __init__(self, prefill: _Optional[int] = ..., decode: _Optional[int] = ..., timeout_s: _Optional[float] = ...) -> None: ...

class ScaleResponse(_message.Message):
    __slots__ = ("pools",)
    POOLS_FIELD_NUMBER: _ClassVar[int]
    pools: _containers.RepeatedCompositeFieldContainer[PoolChange]
    def __init__(self, pools: _Optional[_Iterable[_Union[PoolChange, _Mapping]]] = ...) -> None: ...

class PoolChange(_message.Message):
    __slots__ = ("role", "size_before", "size_after", "added", "removed", "pending", "failed")
    ROLE_FIELD_NUMBER: _ClassVar[int]
    SIZE_BEFORE_FIELD_NUMBER: _ClassVar[int]
    SIZE_AFTER_FIELD_NUMBER: _ClassVar[int]
    ADDED_FIELD_NUMBER: _ClassVar[int]
    REMOVED_FIELD_NUMBER: _ClassVar[int]
    PENDING_FIELD_NUMBER: _ClassVar[int]
    FAILED_FIELD_NUMBER: _ClassVar[int]
    role: str
    size_before: int
    size_after: int
    added: _containers.RepeatedScalarFieldContainer[str]
    removed: _containers.RepeatedScalarFieldContainer[str]
    pending: _containers.RepeatedScalarFieldContainer[str]
    failed: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, role: _Optional[str] = ..., size_before: _Optional[int] = ..., size_after: _Optional[int] = ..., added: _Optional[_Iterable[str]] = ..., removed: _Optional[_Iterable[str]] = ..., pending: _Optional[_Iterable[str]] = ..., failed: _Optional[_Iterable[str]] = ...) -> None: ...

class DrainRequest(_message.Message):
    __slots__ = ("instance_id", "timeout_s")
    INSTANCE_ID_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_S_FIELD_NUMBER: _ClassVar[int]
    instance_id: str
    timeout_s: float
    def __init__(self, instance_id: _Optional[str] = ..., timeout_s: _Optional[float] = ...) -> None: ...

class DrainResponse(_message.Message):
    __slots__ = ("instance_id", "drained_requests", "drain_s")
    INSTANCE_ID_FIELD_NUMBER: _ClassVar[int]
    DRAINED_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    DRAIN_S_FIELD_NUMBER: _ClassVar[int]
    instance_id: str
    drained_requests: int
    drain_s: float
    def __init__(self, instance_id: _Optional[str] = ..., drained_requests: _Optional[int] = ..., drain_s: _Optional[float] = ...) -> None: ...

class PinRequest(_message.Message):
    __slots__ = ("name", "text", "token_ids", "cache_salt")
    NAME_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    CACHE_SALT_FIELD_NUMBER: _ClassVar[int]
    name: str
    text: str
    token_ids: _inference_pb2.TokenIds
    cache_salt: str
    def __init__(self, name: _Optional[str] = ..., text: _Optional[str] = ..., token_ids: _Optional[_Union[_inference_pb2.TokenIds, _Mapping]] = ..., cache_salt: _Optional[str] = ...) -> None: ...

class UnpinRequest(_message.Message):
    __slots__ = ("name",)
    NAME_FIELD_NUMBER: _ClassVar[int]
    name: str
    def __init__(self, name: _Optional[str] = ...) -> None: ...

class SoftPin(_message.Message):
    __slots__ = ("name", "num_blocks", "num_tokens", "present_blocks_by_node")
    class PresentBlocksByNodeEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    NAME_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PRESENT_BLOCKS_BY_NODE_FIELD_NUMBER: _ClassVar[int]
    name: str
    num_blocks: int
    num_tokens: int
    present_blocks_by_node: _containers.ScalarMap[str, int]
    def __init__(self, name: _Optional[str] = ..., num_blocks: _Optional[int] = ..., num_tokens: _Optional[int] = ..., present_blocks_by_node: _Optional[_Mapping[str, int]] = ...) -> None: ...
