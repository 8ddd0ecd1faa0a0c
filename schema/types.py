"""The plan file's types: the only contract between compiler, runner, inspector and CI.

Every struct is frozen and forbids unknown fields, so a plan written by a newer compiler that adds a
field fails to decode here; adding a field is therefore a ``schema_version`` step (see ``versions``).
``schema/plan.schema.json`` describes the same document; a test fails if the two drift apart.

All byte counts are integers. Schedule time is measured in *slots*: ``Tensor.interval = [s, e]`` means
the tensor is written in slot ``s`` and last read in slot ``e`` (both inclusive).
"""

from __future__ import annotations

from typing import Any, Literal

import msgspec

SCHEMA_VERSION = 1

# Bound byte counts so absurd sizes (10^30) are rejected at decode time: 2^53 bytes = 8 PiB.
MAX_BYTES = 2**53

Bytes = msgspec.Meta(ge=0, le=MAX_BYTES)
Count = msgspec.Meta(ge=0, le=2**31)


class _Base(msgspec.Struct, frozen=True, forbid_unknown_fields=True, omit_defaults=True):
    pass


class Generator(_Base):
    """Versions of the tools that wrote the plan (MLX primitive encoding is version-specific)."""

    dctms: str
    mlx: str
    mlx_lm: str


class KVStorage(_Base):
    """How the static KV cache is stored: plain ``dtype``, or affine-quantised with ``bits``."""

    dtype: str
    bits: int | None = None
    group_size: int | None = None


class Bounds(_Base):
    input_tokens: int  # N: longest prompt accepted
    output_tokens: int  # M: most tokens generated
    batch: int
    prefill_chunk: int  # tokens per prefill call; the last chunk is padded and masked
    dtype: str  # activation / weight dtype of the model
    kv: KVStorage
    kv_capacity: int  # positions allocated in the static cache (>= N + M)


class Quantization(_Base):
    group_size: int
    bits: int
    mode: str = "affine"


class WeightTensor(_Base):
    name: str
    shape: list[int]
    dtype: str
    bytes: int


class Weights(_Base):
    """Fingerprint of the parameters the plan was compiled for."""

    count: int
    total_bytes: int
    layout_sha256: str  # sha256 of the canonical (name, shape, dtype) list
    tensors: list[WeightTensor]
    files_sha256: dict[str, str] | None = None  # per safetensors file, when weights were present


class ModelInfo(_Base):
    architecture: str  # mlx-lm model_type, e.g. "qwen2"
    config_sha256: str  # sha256 of the canonical JSON of config.json
    num_layers: int
    vocab_size: int
    weights: Weights
    quantization: Quantization | None = None


class TargetProfile(_Base):
    """Roofline figures used by the scheduler's bandwidth constraint, each with its source."""

    name: str
    peak_flops: float
    peak_flops_source: str
    bandwidth_bytes_per_s: float
    bandwidth_source: str


class Target(_Base):
    backend: str  # "cpu" or "gpu": the MLX device the graph was traced for
    alignment: int
    profile: TargetProfile
    device_memory: int | None = None


class StateTensor(_Base):
    """Memory that lives across steps, allocated once at plan capacity (KV cache, ...)."""

    name: str
    kind: str  # "kv" or "persistent"
    shape: list[int]
    dtype: str
    bytes: int


class Binding(_Base):
    """A graph input or output and what it is bound to at run time.

    kind "input": a per-call array the runner provides (``tokens``, ``position``, ``last_index``);
    kind "weight": a model parameter by its path; kind "state": a ``StateTensor`` by name;
    kind "output": a per-call result (``next_token``).
    """

    id: str
    kind: Literal["input", "weight", "state", "output"]
    name: str
    shape: list[int]
    dtype: str


class Constant(_Base):
    """A constant baked into the graph; ``value`` is the flattened array (row-major)."""

    id: str
    shape: list[int]
    dtype: str
    value: list[Any]


class Op(_Base):
    """One MLX primitive. ``args`` is the primitive's own argument list as MLX's exporter gives it."""

    index: int
    primitive: str
    inputs: list[str]
    outputs: list[str]
    args: list[Any] = []
    layer: int | None = None  # decoder layer the op belongs to, when known
    memory_bound: bool = False  # arithmetic intensity below the target's ridge point
    scratch: int = 0  # temporary bytes MLX allocates inside this op (e.g. contiguous copies)


class Tensor(_Base):
    """A primitive output. Views (``view_of`` set) alias another tensor's bytes and own none."""

    id: str
    shape: list[int]
    dtype: str
    bytes: int
    interval: list[int]  # [first slot, last slot], inclusive
    buffer: int | None = None
    offset: int | None = None
    view_of: str | None = None
    kind: Literal["intermediate", "state", "output"] = "intermediate"


class Buffer(_Base):
    """A physical buffer of the interval colouring, sized to its largest tenant."""

    id: int
    bytes: int


class SyncPoint(_Base):
    slot: int  # the host waits after this slot
    reason: str


class Phase(_Base):
    name: str
    tokens: int  # tokens processed per call of this phase
    inputs: list[Binding]
    outputs: list[Binding]
    constants: list[Constant]
    ops: list[Op]
    tensors: list[Tensor]
    buffers: list[Buffer]
    slots: list[list[int]]
    sync_points: list[SyncPoint]
    arena_bytes: int
    lower_bound_bytes: int


class Envelope(_Base):
    """M_max = weights + kv + persistent + intermediate + runtime (all bytes)."""

    weights: int
    kv: int
    persistent: int
    intermediate: int
    runtime: int
    total: int
    runtime_source: str = ""
    device: int | None = None
    free: int | None = None


class Stats(_Base):
    """The paper's Table 1 figures plus the arena against its lower bound."""

    logical_tensors: int
    physical_buffers: int
    reduction: float  # 1 - physical_buffers / logical_tensors
    arena_bytes: int
    lower_bound_bytes: int


class Plan(_Base):
    schema_version: int
    generator: Generator
    bounds: Bounds
    model: ModelInfo
    target: Target
    state: list[StateTensor]
    phases: list[Phase]
    envelope: Envelope
    stats: Stats
