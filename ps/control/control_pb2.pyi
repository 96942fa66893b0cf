from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class GetStatusRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class WorkerStatus(_message.Message):
    __slots__ = ("slot", "last_push_age_seconds")
    SLOT_FIELD_NUMBER: _ClassVar[int]
    LAST_PUSH_AGE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    slot: int
    last_push_age_seconds: float
    def __init__(self, slot: _Optional[int] = ..., last_push_age_seconds: _Optional[float] = ...) -> None: ...

class SlotProgress(_message.Message):
    __slots__ = ("slot", "next_step", "durable_next_step", "finished_steps", "live")
    SLOT_FIELD_NUMBER: _ClassVar[int]
    NEXT_STEP_FIELD_NUMBER: _ClassVar[int]
    DURABLE_NEXT_STEP_FIELD_NUMBER: _ClassVar[int]
    FINISHED_STEPS_FIELD_NUMBER: _ClassVar[int]
    LIVE_FIELD_NUMBER: _ClassVar[int]
    slot: int
    next_step: int
    durable_next_step: int
    finished_steps: int
    live: bool
    def __init__(self, slot: _Optional[int] = ..., next_step: _Optional[int] = ..., durable_next_step: _Optional[int] = ..., finished_steps: _Optional[int] = ..., live: _Optional[bool] = ...) -> None: ...

class CheckpointInfo(_message.Message):
    __slots__ = ("path", "version", "age_seconds")
    PATH_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    AGE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    path: str
    version: int
    age_seconds: float
    def __init__(self, path: _Optional[str] = ..., version: _Optional[int] = ..., age_seconds: _Optional[float] = ...) -> None: ...

class GetStatusResponse(_message.Message):
    __slots__ = ("model_version", "mode", "optimizer", "paused", "uptime_seconds", "workers", "newest_checkpoint", "checkpointing_enabled", "shutting_down", "server_id", "checkpoint_error", "slots", "shard_index", "shard_count", "intra_op_threads", "replica", "thread_budget", "host_processes")
    MODEL_VERSION_FIELD_NUMBER: _ClassVar[int]
    MODE_FIELD_NUMBER: _ClassVar[int]
    OPTIMIZER_FIELD_NUMBER: _ClassVar[int]
    PAUSED_FIELD_NUMBER: _ClassVar[int]
    UPTIME_SECONDS_FIELD_NUMBER: _ClassVar[int]
    WORKERS_FIELD_NUMBER: _ClassVar[int]
    NEWEST_CHECKPOINT_FIELD_NUMBER: _ClassVar[int]
    CHECKPOINTING_ENABLED_FIELD_NUMBER: _ClassVar[int]
    SHUTTING_DOWN_FIELD_NUMBER: _ClassVar[int]
    SERVER_ID_FIELD_NUMBER: _ClassVar[int]
    CHECKPOINT_ERROR_FIELD_NUMBER: _ClassVar[int]
    SLOTS_FIELD_NUMBER: _ClassVar[int]
    SHARD_INDEX_FIELD_NUMBER: _ClassVar[int]
    SHARD_COUNT_FIELD_NUMBER: _ClassVar[int]
    INTRA_OP_THREADS_FIELD_NUMBER: _ClassVar[int]
    REPLICA_FIELD_NUMBER: _ClassVar[int]
    THREAD_BUDGET_FIELD_NUMBER: _ClassVar[int]
    HOST_PROCESSES_FIELD_NUMBER: _ClassVar[int]
    model_version: int
    mode: str
    optimizer: str
    paused: bool
    uptime_seconds: float
    workers: _containers.RepeatedCompositeFieldContainer[WorkerStatus]
    newest_checkpoint: CheckpointInfo
    checkpointing_enabled: bool
    shutting_down: bool
    server_id: str
    checkpoint_error: str
    slots: _containers.RepeatedCompositeFieldContainer[SlotProgress]
    shard_index: int
    shard_count: int
    intra_op_threads: int
    replica: ReplicaStatus
    thread_budget: str
    host_processes: int
    def __init__(self, model_version: _Optional[int] = ..., mode: _Optional[str] = ..., optimizer: _Optional[str] = ..., paused: _Optional[bool] = ..., uptime_seconds: _Optional[float] = ..., workers: _Optional[_Iterable[_Union[WorkerStatus, _Mapping]]] = ..., newest_checkpoint: _Optional[_Union[CheckpointInfo, _Mapping]] = ..., checkpointing_enabled: _Optional[bool] = ..., shutting_down: _Optional[bool] = ..., server_id: _Optional[str] = ..., checkpoint_error: _Optional[str] = ..., slots: _Optional[_Iterable[_Union[SlotProgress, _Mapping]]] = ..., shard_index: _Optional[int] = ..., shard_count: _Optional[int] = ..., intra_op_threads: _Optional[int] = ..., replica: _Optional[_Union[ReplicaStatus, _Mapping]] = ..., thread_budget: _Optional[str] = ..., host_processes: _Optional[int] = ...) -> None: ...

class ReplicaStatus(_message.Message):
    __slots__ = ("role", "epoch", "primary", "standby", "lag_updates", "lag_seconds", "failovers", "configured", "replication", "max_lag", "unreplicated")
    ROLE_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    PRIMARY_FIELD_NUMBER: _ClassVar[int]
    STANDBY_FIELD_NUMBER: _ClassVar[int]
    LAG_UPDATES_FIELD_NUMBER: _ClassVar[int]
    LAG_SECONDS_FIELD_NUMBER: _ClassVar[int]
    FAILOVERS_FIELD_NUMBER: _ClassVar[int]
    CONFIGURED_FIELD_NUMBER: _ClassVar[int]
    REPLICATION_FIELD_NUMBER: _ClassVar[int]
    MAX_LAG_FIELD_NUMBER: _ClassVar[int]
    UNREPLICATED_FIELD_NUMBER: _ClassVar[int]
    role: str
    epoch: int
    primary: str
    standby: str
    lag_updates: float
    lag_seconds: float
    failovers: int
    configured: int
    replication: str
    max_lag: int
    unreplicated: float
    def __init__(self, role: _Optional[str] = ..., epoch: _Optional[int] = ..., primary: _Optional[str] = ..., standby: _Optional[str] = ..., lag_updates: _Optional[float] = ..., lag_seconds: _Optional[float] = ..., failovers: _Optional[int] = ..., configured: _Optional[int] = ..., replication: _Optional[str] = ..., max_lag: _Optional[int] = ..., unreplicated: _Optional[float] = ...) -> None: ...

class CheckpointRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class CheckpointResponse(_message.Message):
    __slots__ = ("path", "version")
    PATH_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    path: str
    version: int
    def __init__(self, path: _Optional[str] = ..., version: _Optional[int] = ...) -> None: ...

class PauseRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class PauseResponse(_message.Message):
    __slots__ = ("changed", "model_version")
    CHANGED_FIELD_NUMBER: _ClassVar[int]
    MODEL_VERSION_FIELD_NUMBER: _ClassVar[int]
    changed: bool
    model_version: int
    def __init__(self, changed: _Optional[bool] = ..., model_version: _Optional[int] = ...) -> None: ...

class ResumeRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ResumeResponse(_message.Message):
    __slots__ = ("changed", "model_version")
    CHANGED_FIELD_NUMBER: _ClassVar[int]
    MODEL_VERSION_FIELD_NUMBER: _ClassVar[int]
    changed: bool
    model_version: int
    def __init__(self, changed: _Optional[bool] = ..., model_version: _Optional[int] = ...) -> None: ...

class ShutdownRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ShutdownResponse(_message.Message):
    __slots__ = ("changed",)
    CHANGED_FIELD_NUMBER: _ClassVar[int]
    changed: bool
    def __init__(self, changed: _Optional[bool] = ...) -> None: ...

class ExportModelRequest(_message.Message):
    __slots__ = ("format", "optimizer_state", "part_rows")
    FORMAT_FIELD_NUMBER: _ClassVar[int]
    OPTIMIZER_STATE_FIELD_NUMBER: _ClassVar[int]
    PART_ROWS_FIELD_NUMBER: _ClassVar[int]
    format: str
    optimizer_state: bool
    part_rows: int
    def __init__(self, format: _Optional[str] = ..., optimizer_state: _Optional[bool] = ..., part_rows: _Optional[int] = ...) -> None: ...

class ExportModelChunk(_message.Message):
    __slots__ = ("data", "model_version", "total_bytes", "path")
    DATA_FIELD_NUMBER: _ClassVar[int]
    MODEL_VERSION_FIELD_NUMBER: _ClassVar[int]
    TOTAL_BYTES_FIELD_NUMBER: _ClassVar[int]
    PATH_FIELD_NUMBER: _ClassVar[int]
    data: bytes
    model_version: int
    total_bytes: int
    path: str
    def __init__(self, data: _Optional[bytes] = ..., model_version: _Optional[int] = ..., total_bytes: _Optional[int] = ..., path: _Optional[str] = ...) -> None: ...
