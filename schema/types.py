"""The plan file's types: the only contract between compiler, runner, inspector and CI.

Every struct is frozen and forbids unknown fields, so a plan written by a newer compiler that adds a
field fails to decode here; adding a field is therefore a ``schema_version`` step (see ``versions``).
``schema/plan.schema.json`` describes the same document; a test fails if the two drift apart.

All byte counts are integers. Schedule time is measured in *slots*: ``Tensor.interval = [s, e]`` means
the tensor is written in slot ``s`` and last read in slot ``e`` (both inclusive).
"""

from __future__ import annotations

from typing import Annotated, Any, ClassVar, Literal

import msgspec

SCHEMA_VERSION = 6

# Bound byte counts so absurd sizes (10^30) are rejected at decode time: 2^53 bytes = 8 PiB.
MAX_BYTES = 2**53

Bytes = msgspec.Meta(ge=0, le=MAX_BYTES)
Count = msgspec.Meta(ge=0, le=2**31)

# Value constraints (checked by msgspec on decode and by plan.schema.json). Semantic checks that relate
# fields to each other (e.g. batch >= 1, kv_capacity >= N + M) live in ``verify`` so they get readable,
# rule-named messages instead of bare range errors.
ByteCount = Annotated[int, Bytes]
Int = Annotated[int, Count]  # counts, indices, shape dimensions, slots
Positive = Annotated[int, msgspec.Meta(ge=1, le=2**31)]
SignedBytes = Annotated[int, msgspec.Meta(ge=-MAX_BYTES, le=MAX_BYTES)]  # envelope.free may be negative
Name = Annotated[str, msgspec.Meta(min_length=1)]
Sha256 = Annotated[str, msgspec.Meta(pattern="^[0-9a-f]{64}$")]
Shape = list[Int]
NonNegFloat = Annotated[float, msgspec.Meta(ge=0)]
Fraction = Annotated[float, msgspec.Meta(ge=0, le=1)]
Interval = Annotated[list[Int], msgspec.Meta(min_length=2, max_length=2)]

# Closed sets of names: anything else fails to decode.
Backend = Literal["cpu", "gpu"]
StateKind = Literal["kv", "persistent"]
BindingKind = Literal["input", "weight", "state", "output"]
TensorKind = Literal["intermediate", "output", "state", "scratch"]
ParallelMode = Literal["pipeline", "tensor"]
RunAhead = Literal["free", "throttled"]


class _Base(msgspec.Struct, frozen=True, forbid_unknown_fields=True, omit_defaults=True):
    pass


class Generator(_Base):
    """Versions of the tools that wrote the plan (MLX primitive encoding is version-specific)."""

    dctms: Name
    mlx: Name
    mlx_lm: Name


class KVStorage(_Base):
    """How the static KV cache is stored: plain ``dtype``, or affine-quantised with ``bits``."""

    dtype: Name
    bits: Positive | None = None
    group_size: Positive | None = None
    # mlx-lm's quantized_kv_start T: calls starting below T attend in float (the state named
    # "<cache>.float" holds their keys and values), the later ones over the quantised cache
    quantized_start: Int = 0


class Bounds(_Base):
    input_tokens: Int  # N: longest prompt accepted
    output_tokens: Int  # M: most tokens generated
    batch: Int
    prefill_chunk: Int  # tokens per prefill call; the last chunk is padded and masked
    dtype: Name  # activation / weight dtype of the model
    kv: KVStorage
    kv_capacity: Int  # positions allocated in the static cache (>= N + M)
    # A prompt-prefix pool (toolkit.prefix_pool): blocks of prefill_chunk positions that keep the
    # prefixes of earlier requests across calls; 0: none. A plan with a pool runs in slots.
    prefix_blocks: Int = 0


class Quantization(_Base):
    group_size: Positive
    bits: Positive
    mode: Name = "affine"


class RankShard(_Base):
    """How a tensor-parallel rank cuts its weight from the stored tensor, as mlx.nn's ``_shard``
    does: split ``stored_shape`` along ``axis`` into ``segments``, each of those into ``parts``, keep
    part ``index`` of every segment, concatenated along ``axis``."""

    stored_shape: Shape
    axis: Int
    parts: Positive
    index: Int
    segments: Positive = 1


class WeightTensor(_Base):
    name: Name
    shape: Shape
    dtype: Name  # as resident in memory (what ``bytes`` counts)
    bytes: ByteCount
    # As stored in the safetensors file, when the plan casts it at load (``compile --dtype``).
    stored_dtype: Name | None = None
    # A tensor-parallel rank's slice of the stored tensor (``shape`` is the slice's).
    shard: RankShard | None = None


class FusedWeight(_Base):
    """A weight the phases read that is several of ``tensors`` end to end along axis 0 (a layer's
    query, key and value projections, or its gate and up projections): one matmul instead of
    several. The runner lays the parts out next to each other and reads the fused weight as one
    view of them, so it costs no bytes of its own; a phase never binds a part."""

    name: Name
    parts: list[Name]


class Weights(_Base):
    """Fingerprint of the parameters the plan was compiled for."""

    count: Int
    total_bytes: ByteCount
    layout_sha256: Sha256  # sha256 of the canonical (name, shape, dtype) list
    tensors: list[WeightTensor]
    files_sha256: dict[Name, Sha256] | None = (
        None  # per safetensors file, when weights were present
    )
    fused: list[FusedWeight] = []  # toolkit.fuse_projections


class ModelInfo(_Base):
    architecture: Name  # mlx-lm model_type, e.g. "qwen2"
    config_sha256: Sha256  # sha256 of the canonical JSON of config.json
    num_layers: Int
    vocab_size: Int
    weights: Weights
    quantization: Quantization | None = None


class TargetProfile(_Base):
    """Roofline figures used by the scheduler's bandwidth constraint, each with its source."""

    name: Name
    peak_flops: NonNegFloat
    peak_flops_source: Name
    bandwidth_bytes_per_s: NonNegFloat
    bandwidth_source: Name


class MemoryModel(_Base):
    """The GPU allocator a plan is modelled for, written from MLX's source (``schema.targets``):
    *modelled*, not measured. The verifier re-derives every field from ``name``, ``mlx`` and the
    target profile."""

    name: Literal["metal", "cuda"]
    mlx: Name  # the MLX minor whose allocator source the model follows
    page_bytes: Positive  # requests are rounded to pages (metal: above one page; cuda: from one)
    small_bytes: Int  # metal: below it, the 1 MiB heap; cuda: at most it, the 8-byte pool
    ops_per_buffer: Positive  # kernel ops per command buffer (metal) or CUDA graph, MLX's default
    active_tasks: Positive  # committed buffers the host lets be outstanding (MAX_ACTIVE_TASKS)
    not_modelled: list[Name] = []  # what the model leaves out, said in the plan itself


class Target(_Base):
    backend: Backend  # the MLX device the plan runs on (a GPU target's graph is traced on the CPU)
    alignment: Positive
    profile: TargetProfile
    device_memory: ByteCount | None = None
    # CPU backend: encoder dispatches the host may run ahead of the worker thread; lifetimes are
    # widened by it (see dctms.toolkit.lifetimes). 0 means the plan assumes no run-ahead.
    run_ahead_dispatches: Int = 0
    # The allocator may hand a request of S bytes a cached buffer up to min(S, allocator_slack) bytes
    # larger and then counts its whole size (MLX's BufferCache: < min(2 S, S + 2 pages)).
    allocator_slack: Int = 0
    # GPU targets (compile --target metal | cuda): the allocator model; None for the CPU's model
    # (dctms.toolkit.memory_model) and for plans traced natively on a GPU (--backend gpu).
    memory_model: MemoryModel | None = None


class SlidingWindow(_Base):
    """A sliding-window layer's cache as a ring (mlx-lm's ``RotatingKVCache``, keep 0): position p
    is written at slot ``p mod slots``, and attention sees the last ``window`` positions.
    ``slots`` is a multiple of ``bounds.prefill_chunk`` and at least ``window - 1 + chunk``."""

    window: Positive
    slots: Positive
    # tokens mlx-lm's RotatingKVCache keeps at the start (4 with --max-kv-size); their arrays are
    # the state named "<ring>.keep" (keep slots, then keep sink slots)
    keep: Int = 0


class StateTensor(_Base):
    """Memory that lives across steps, allocated once at plan capacity (KV cache, ...)."""

    name: Name
    kind: StateKind
    shape: Shape
    dtype: Name
    bytes: ByteCount
    window: SlidingWindow | None = None  # a ring of ``window.slots`` positions, not kv_capacity
    # A recurrent layer's state (mlx-lm's ArraysCache): replaced by every call, so the runner
    # feeds prompts in whole chunks and single tokens (never padded)
    recurrent: bool = False


class Binding(_Base):
    """A graph input or output and what it is bound to at run time.

    kind "input": a per-call array the runner provides (``tokens``, ``position``, ``last_index``);
    kind "weight": a model parameter by its path; kind "state": a ``StateTensor`` by name;
    kind "output": a per-call result (``next_token``).
    """

    id: Name
    kind: BindingKind
    name: Name
    shape: Shape
    dtype: Name


class Constant(_Base):
    """A constant baked into the graph; ``value`` is the flattened array (row-major)."""

    id: Name
    shape: Shape
    dtype: Name
    value: list[Any]


class Op(_Base):
    """One MLX primitive. ``args`` is the primitive's own argument list as MLX's exporter gives it.

    An op is named by its position in ``Phase.ops`` (slots, scratch owners, length places)."""

    primitive: Name
    inputs: list[Name]
    outputs: list[Name]
    args: list[Any] = []
    memory_bound: bool = False  # arithmetic intensity below the target's ridge point
    scratch: ByteCount = 0  # temporary bytes MLX allocates inside this op (e.g. contiguous copies)


class Tensor(_Base, tag_field="kind"):
    """What every tensor record has. A plan holds only the variants below, told apart by ``kind``.

    Views (``view_of`` set) alias another tensor's bytes and own none; a tensor that owns bytes is an
    arena tenant with a ``buffer`` and an ``offset``.
    """

    id: Name
    shape: Shape
    dtype: Name
    bytes: ByteCount
    interval: Interval  # [first slot, last slot], inclusive
    buffer: Int | None = None
    offset: ByteCount | None = None
    view_of: Name | None = None
    kind: ClassVar[TensorKind]


class Intermediate(Tensor, tag="intermediate"):
    """A primitive output that is neither a phase output nor the cache: lives between two slots."""

    kind: ClassVar[Literal["intermediate"]] = "intermediate"


class Output(Tensor, tag="output"):
    """A phase output the runner reads back (``next_token``): live until the last slot."""

    kind: ClassVar[Literal["output"]] = "output"


class StateView(Tensor, tag="state"):
    """The cache after an in-place update: a view of the state input binding named by ``view_of``."""

    kind: ClassVar[Literal["state"]] = "state"


class Scratch(Tensor, tag="scratch", kw_only=True):
    """A temporary MLX allocates inside op ``op`` (its position in ``Phase.ops``): uint8 of shape ``[bytes]``."""

    op: Int
    kind: ClassVar[Literal["scratch"]] = "scratch"


AnyTensor = Intermediate | Output | StateView | Scratch
TENSOR_VARIANTS: dict[str, type[Tensor]] = {
    cls.kind: cls for cls in (Intermediate, Output, StateView, Scratch)
}


def as_kind(tensor: Tensor, kind: str) -> AnyTensor:
    """``tensor`` as the variant ``kind`` (same fields; a scratch owner is kept only by scratch)."""
    fields = msgspec.structs.asdict(tensor)
    if kind != "scratch":
        fields.pop("op", None)
    return TENSOR_VARIANTS[kind](**fields)


class Buffer(_Base):
    """A physical buffer of the interval colouring, sized to its largest tenant."""

    id: Int
    bytes: ByteCount


class SyncPoint(_Base):
    slot: Int  # the host waits after this slot
    reason: Name
    # Tensors the runner passes to mx.eval here, in this order: those made since the previous
    # sync point that are read later, and the phase outputs made since then.
    evaluate: list[Name] = []


LengthName = Literal["tokens", "window", "rows"]  # rows: a batched decode's busy slots
SignedInt = Annotated[int, msgspec.Meta(ge=-(2**31), le=2**31)]


class LengthAffine(_Base):
    """Every place in ``at`` holds ``sum(k[d] * length[d]) + c`` (places grouped by function).

    A place is ``"o<op index>/<path>"`` (an op argument: ``o40/0.1`` is ``ops[40].args[0][1]``) or
    ``"i<binding id>/<axis>"`` (a dimension of an input binding)."""

    k: list[SignedInt]
    c: SignedInt
    at: list[Name]


class Lengths(_Base):
    """The lengths a phase can run at under this one plan (see dctms.toolkit.lengths).

    The phase's ops, tensors and arena are those at ``bound``; at another of the ``points`` the
    runner creates the same primitives with the arguments ``affine`` gives. The compiler verified at
    every point that each tensor is at most its planned size with the planned lifetime."""

    names: list[LengthName]
    bound: list[Positive]
    points: list[list[Positive]]  # verified combinations, in ``names`` order; the bound first
    affine: list[LengthAffine] = []


class ModuleRuns(_Base):
    """The module that created each op, run-length coded: the first ``lengths[0]`` ops are
    ``modules[0]``'s (a node of ``Plan.modules``), the next ``lengths[1]`` ops ``modules[1]``'s, and
    so on. A tensor belongs to the module of the op that produces it."""

    lengths: list[Positive]
    modules: list[Int]


class Phase(_Base):
    name: Name
    tokens: Int  # tokens processed per call of this phase
    inputs: list[Binding]
    outputs: list[Binding]
    constants: list[Constant]
    ops: list[Op]
    tensors: list[AnyTensor]
    buffers: list[Buffer]
    slots: list[list[Int]]
    sync_points: list[SyncPoint]
    arena_bytes: ByteCount
    lower_bound_bytes: ByteCount
    # What proves arena_bytes minimal: "lower_bound" (it equals lower_bound_bytes), "search" (an
    # exhaustive search found no packing in fewer bytes), or absent when nothing does; then
    # arena_gap_bytes says how far above a proven lower bound on the optimum the arena may be.
    arena_optimal: Literal["lower_bound", "search"] | None = None
    arena_gap_bytes: ByteCount = 0
    # Most bytes the allocator's cache reuse can add at once: max over slots of the sum over live
    # arena tenants of min(bytes, target.allocator_slack). M_intermediate covers arena + slack.
    slack_bytes: ByteCount = 0
    # None: fixed shapes (the runner pads every call to them); else the real-length points.
    lengths: Lengths | None = None
    modules: ModuleRuns | None = None  # None when the trace could not attribute ops to modules


class EnvelopePart(_Base):
    """One model's share of a plan that holds two (speculative decoding: the target and its draft).

    Both models stay resident for the whole run, so the plan's weights, kv and persistent are the
    sums of the parts; their calls never overlap (the runner drains one model's call before it
    starts the other's), so the plan's intermediate is the largest of the parts' arenas."""

    model: Literal["target", "draft"]
    weights: ByteCount
    kv: ByteCount
    persistent: ByteCount
    intermediate: ByteCount  # the model's largest phase arena plus allocator slack


class Envelope(_Base):
    """M_max = weights + kv + persistent + intermediate + runtime (all bytes)."""

    weights: ByteCount
    kv: ByteCount
    persistent: ByteCount
    intermediate: ByteCount
    runtime: ByteCount
    total: ByteCount
    runtime_source: str = ""
    device: ByteCount | None = None
    free: SignedBytes | None = None
    # Per model, in a plan with a draft: [target, draft] (see EnvelopePart); empty otherwise.
    parts: list[EnvelopePart] = []

    @property
    def provable(self) -> int:
        """The part of M_max that MLX's own peak memory must never exceed (all but runtime)."""
        return self.weights + self.kv + self.persistent + self.intermediate


class Stats(_Base):
    """The paper's Table 1 figures plus the arena against its lower bound."""

    logical_tensors: Int
    physical_buffers: Int
    reduction: Fraction  # 1 - physical_buffers / logical_tensors
    arena_bytes: ByteCount
    lower_bound_bytes: ByteCount


class VisionRequest(_Base):
    """The vision options a plan was compiled with (``compile --images K --image-size HxW``)."""

    images: Positive
    height: Positive
    width: Positive
    overlap: bool = False


class HubSource(_Base):
    """A model named by its Hugging Face id: the repository and the snapshot's commit hash, which
    ``dctms check`` finds in any machine's Hugging Face cache (no absolute path is recorded)."""

    repo_id: Name
    revision: Annotated[str, msgspec.Meta(pattern="^[0-9a-f]{40}$")]


class CompileRequest(_Base):
    """What the plan was compiled from, exactly as asked: the model's config.json and every compile
    option as given (None / the default where the compiler chose), so ``dctms check`` can re-compile
    the plan the same way and a changed compiler default shows as drift. The values the compiler
    resolved are in ``bounds`` and ``target``; the verifier checks the two agree."""

    config: dict[str, Any]  # config.json as read; its canonical sha256 is model.config_sha256
    input_tokens: Int
    output_tokens: Int
    batch: Int = 1
    prefill_chunk: Int | None = None
    dtype: Name | None = None
    device_memory: ByteCount | None = None
    backend: Name | None = None
    target: Name | None = None  # compile --target as given (cpu, metal[-PROFILE], cuda)
    alignment: Positive = 64
    profile: Name | None = None
    sync_every: Int = 0
    # How far MLX's host may run ahead of the worker: "free" (MLX's own bound, 120 dispatches; no
    # throttle) or "throttled" (10, held there by the runner's memory limit).
    run_ahead: RunAhead = "free"
    hash_weights: bool = False
    pack_seconds: NonNegFloat = 2.0  # the packer's search budget (a fixed amount of work)
    real_lengths: bool = True  # False: fixed phases without length points (dctms fit's probes)
    # The length grid's steps as given (None: the compiler's defaults, 16 tokens / 32 positions).
    token_step: Positive | None = None
    window_step: Positive | None = None
    # mlx-lm's kv_bits / kv_group_size / quantized_kv_start (None bits: a float KV cache)
    kv_bits: Positive | None = None
    kv_group_size: Positive = 64
    quantized_kv_start: Int = 0
    max_kv_size: Positive | None = None  # mlx-lm's max_kv_size (rotating caches keeping 4 tokens)
    # One rank of a distributed model (see Distributed): ranks > 1 with parallel and rank.
    ranks: Positive = 1
    rank: Int = 0
    parallel: ParallelMode | None = None
    split: list[Positive] | None = None
    vision: VisionRequest | None = None  # a vision-language plan's image bounds
    draft_config: dict[str, Any] | None = None  # the draft model's config.json (compile --draft)
    num_draft: Int = 0  # tokens the draft proposes per verify call (compile --num-draft)
    sampling: bool = False  # compile --sampling: mlx-lm's sampler and logits processors traced in
    prefix_blocks: Int = 0  # compile --prefix-blocks K (or --prefix-cache SIZE, resolved to K)
    prefix_cache: ByteCount | None = None  # compile --prefix-cache SIZE as given
    # The Hugging Face id the model was named by (`dctms compile ORG/NAME`); None: a folder or a
    # config.json (absent from the file, so those plans are as before).
    hub: HubSource | None = None
    # compile --fused: MLX's fused kernels as plan ops in a CPU plan (a GPU target has them always)
    fused: bool = False


class Distributed(_Base):
    """This plan is one rank of a model split over ``ranks`` processes of mlx.distributed, by
    mlx-lm's own ``pipeline(group)`` or ``shard(group)``. Every rank has a plan file of its own;
    its envelope is that rank's alone (nothing is shared between ranks' processes)."""

    mode: ParallelMode
    ranks: Positive
    rank: Int
    layers: list[Int]  # [start, end): the decoder layers this rank runs, in the model's numbering
    split: list[Positive] = []  # pipeline: layers per rank, in rank order (rank 0 runs the last)
    # Stored weights this rank does not load (pipeline: the other ranks' layers).
    skipped_weights: list[Name] = []


class Stream(_Base):
    """One stream of a vision-language plan's lifetime analysis and which phases run on it.

    ``vision``: the tower and projector, once per image; ``text``: prefill (merged embeddings)
    and decode; ``output``: the generated tokens the host reads. ``mlx_stream`` is the MLX stream
    the runner puts the phases on (0: the default stream)."""

    name: Literal["vision", "text", "output"]
    phases: list[Name]
    mlx_stream: Int = 0


class VisionVariant(_Base):
    """One image size the plan has a vision phase for (after the model's own preprocessing).

    A fixed-resolution tower has one; a dynamic-resolution one (the image size decides the patch
    count) has one per size up to the bound, each phase traced and planned at that size."""

    phase: Name  # the vision phase that encodes an image of this size
    height: Positive
    width: Positive
    tokens: Positive  # feature rows (image tokens) an image of this size fills
    pixel_shape: Shape  # its pixel_values array, as the family's processor makes it


class Vision(_Base):
    """A vision-language plan: its image bounds and the features table the images fill.

    Image k runs the vision phase of its size (``variants``) once and fills rows from
    ``k * tokens_per_image`` of the ``image_features`` table (``feature_rows`` = ``images`` x
    ``tokens_per_image``, the most tokens of any variant); prefill reads the rows of its
    image-token positions (input ``image_rows``). Only the table outlives the vision phase.
    ``mrope``: the text phases take 3-axis rotary positions (input ``rope_positions``).

    ``overlap``: what runs concurrently. False: every vision call runs (and is waited for) before
    prefill starts. True: the vision calls run on MLX stream 1 (the ``vision`` stream's
    ``mlx_stream``), one at a time and in image order, while prefill runs on stream 0; a prefill
    call waits (a sync point where the streams meet) for the vision call of every image whose
    rows it reads, so image k's encoding overlaps the prefill of the text before it (and of
    earlier images). M_intermediate then covers one call of each stream at once: the largest
    text arena plus the largest vision call."""

    family: Name  # mlx-vlm model_type, e.g. "gemma3"
    resolution: Literal["fixed", "dynamic"]
    images: Positive  # K: most images per call
    image_size: Annotated[list[Positive], msgspec.Meta(min_length=2, max_length=2)]  # [H, W]
    tokens_per_image: Positive
    feature_rows: Positive
    hidden_size: Positive
    image_token_id: Int
    variants: list[VisionVariant]
    streams: list[Stream]
    mrope: bool = False
    overlap: bool = False


ParentNode = Annotated[int, msgspec.Meta(ge=-1, le=2**31)]


class ModuleTree(_Base):
    """The model's module paths as a tree, as mlx-lm names its modules: node ``i`` is called
    ``names[i]`` and sits under node ``parents[i]`` (-1: top level; a parent comes before its
    children); its path joins the names from the top with dots (``model.layers.3.self_attn``).
    ``(root)`` is the model's own ``__call__``, ``(step)`` what dctms adds around it (the token
    reshape and greedy sampling)."""

    parents: list[ParentNode]
    names: list[Name]


class Draft(_Base):
    """The draft model of speculative decoding, planned beside the target (``Plan.draft``).

    Its phases ("prefill", "decode") and state (its own static KV cache, at the plan's
    ``bounds.kv_capacity``, and its persistent blocks) are those of a plan of their own; the target
    gets a "verify" phase that processes ``num_draft + 1`` tokens per call. A rejected suffix is
    rewound by moving the write position: nothing is allocated per round."""

    num_draft: Positive
    model: ModelInfo
    state: list[StateTensor]
    phases: list[Phase]
    stats: Stats
    # The draft's own module tree (its phases' ModuleRuns point into it, not into Plan.modules):
    # the draft is verified as a plan of its own (schema.draft.draft_view), against its own layers.
    modules: ModuleTree | None = None


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
    compile: CompileRequest | None = None  # None in plans not written by the compiler (tests)
    vision: Vision | None = None  # vision-language plans only
    draft: Draft | None = None  # speculative decoding: the draft model's part (compile --draft)
    distributed: Distributed | None = None  # set when the plan is one rank of several
    modules: ModuleTree | None = None  # the module paths the phases' ModuleRuns point into
    # sha256 of the canonical plan without this field (dctms.schema.digest): a plan changed after
    # it was written fails to read. Set by io.encode_plan; "" only in plans built in memory.
    digest: Sha256 | Literal[""] = ""
