"""What one primitive of a plan costs on the roofline: FLOPs, and bytes moved by kind of memory.

Pure functions over the plan's own data (an ``Op`` and the shapes and dtypes of what it reads and
writes), so the CLI and the TUI get the same figures. The counts are the *ideal* traffic of each
primitive, one per class:

* matmul ``[.., m, k] @ [.., k, n]``: 2 m k n FLOPs per batch element; quantized matmul the same
  with k taken from the activation (the packed weight, scales and biases are read as stored);
  fused attention 4 L S D per head.
* elementwise: one FLOP per output element; reductions one per input element; softmax and
  log-sum-exp five (max, subtract, exp, sum, divide).
* gather / dynamic slice / a copying slice: read only what is gathered (the output's size in the
  source's dtype), not the whole table.
* KV update (DynamicSliceUpdate into the state, done in place): read and write the update only.
* views move nothing. An elementwise op writing into a donated input (its output a view of that
  input's root, ``schema.aliasing``) still reads its inputs and writes its output. A view input (a broadcast KV cache, a slice) is read once: at most its
  root's bytes, at most its own logical bytes.
* ``scratch`` (temporaries MLX makes inside an op, e.g. matmul's contiguous copies of a broadcast
  cache) is written once and read once.

Bytes are split by what they belong to: ``weights`` (model parameters), ``kv`` (the static cache
and other state), ``activations`` (everything else, constants and inputs included) and ``scratch``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from dctms.schema.aliasing import DONATING
from dctms.schema.sizes import ITEMSIZE
from dctms.schema.types import Op, Phase

MATMUL = frozenset({"Matmul", "AddMM", "BlockMaskedMM", "GatherMM"})
QUANTIZED_MATMUL = frozenset({"QuantizedMatmul", "GatherQMM"})
ATTENTION = frozenset({"ScaledDotProductAttention"})
FIVE_PASS = frozenset({"Softmax", "LogSumExp"})
REDUCTION = frozenset({"Reduce", "ArgReduce", "Scan"}) | FIVE_PASS
GATHER = frozenset({"Gather", "GatherAxis", "DynamicSlice", "Slice", "Take"})
KV_UPDATE = frozenset({"DynamicSliceUpdate", "SliceUpdate", "Scatter", "ScatterAxis"})
COPY = frozenset(
    {"Concatenate", "Copy", "Reshape", "Flatten", "Unflatten", "Pad", "Contiguous", "Split"}
)

# Op classes in the order reports list them.
CLASSES = (
    "matmul",
    "quantized matmul",
    "attention",
    "elementwise",
    "reduction",
    "gather",
    "kv update",
    "copy",
    "view",
)
BYTE_KINDS = ("weights", "kv", "activations", "scratch")


@dataclass(frozen=True)
class OpCost:
    op_class: str
    flops: float
    weights: int = 0
    kv: int = 0
    activations: int = 0
    scratch: int = 0

    @property
    def bytes(self) -> int:
        return self.weights + self.kv + self.activations + self.scratch


@dataclass(frozen=True)
class Value:
    """What an op reads or writes: its shape and dtype, the bytes behind it and their kind."""

    shape: tuple[int, ...]
    dtype: str
    kind: str  # "weights", "kv" or "activations"
    root_bytes: int  # bytes of the storage it lives in (its own for a non-view)
    is_view: bool = False

    @property
    def logical_bytes(self) -> int:
        return math.prod(self.shape) * ITEMSIZE[self.dtype]

    @property
    def read_bytes(self) -> int:
        return min(self.logical_bytes, self.root_bytes)


class PhaseValues:
    """Looks up any id an op of ``phase`` names: bindings, constants and tensors (views resolved
    to the storage they alias)."""

    def __init__(self, phase: Phase) -> None:
        self._roots: dict[str, tuple[str, int]] = {}  # id -> (kind, bytes of its own storage)
        self._shape: dict[str, tuple[list[int], str]] = {}
        self._values: dict[str, Value] = {}  # memo: ops read the same values many times
        kind_of = {"weight": "weights", "state": "kv"}
        for b in [*phase.inputs, *phase.outputs]:
            self._shape[b.id] = (b.shape, b.dtype)
            self._roots[b.id] = (kind_of.get(b.kind, "activations"), _nbytes(b.shape, b.dtype))
        for c in phase.constants:
            self._shape[c.id] = (c.shape, c.dtype)
            self._roots[c.id] = ("activations", _nbytes(c.shape, c.dtype))
        self._view_of: dict[str, str] = {}
        for t in phase.tensors:
            self._shape[t.id] = (t.shape, t.dtype)
            if t.view_of is not None:
                self._view_of[t.id] = t.view_of
            elif t.id not in self._roots:
                self._roots[t.id] = ("activations", t.bytes)

    def is_view(self, tensor_id: str) -> bool:
        return tensor_id in self._view_of

    def value(self, tensor_id: str) -> Value:
        memo = self._values.get(tensor_id)
        if memo is not None:
            return memo
        shape, dtype = self._shape[tensor_id]
        root = tensor_id
        seen = 0
        while root in self._view_of and seen < 64:  # view_of names the root, but be safe
            root, seen = self._view_of[root], seen + 1
        kind, root_bytes = self._roots.get(root, ("activations", _nbytes(shape, dtype)))
        value = Value(tuple(shape), dtype, kind, root_bytes, is_view=tensor_id in self._view_of)
        self._values[tensor_id] = value
        return value


def _nbytes(shape: list[int] | tuple[int, ...], dtype: str) -> int:
    return math.prod(shape) * ITEMSIZE[dtype]


def op_class(primitive: str, outputs: list[Value]) -> str:
    if primitive in MATMUL:
        return "matmul"
    if primitive in QUANTIZED_MATMUL:
        return "quantized matmul"
    if primitive in ATTENTION:
        return "attention"
    if primitive in KV_UPDATE:
        return "kv update"
    if outputs and all(v.is_view for v in outputs) and primitive not in DONATING:
        return "view"
    if primitive in REDUCTION:
        return "reduction"
    if primitive in GATHER:
        return "gather"
    if primitive in COPY:
        return "copy"
    return "elementwise"


def op_flops(primitive: str, inputs: list[Value], outputs: list[Value]) -> float:
    out_elems = math.prod(outputs[0].shape) if outputs else 0
    if primitive in MATMUL or primitive in QUANTIZED_MATMUL:
        k = inputs[0].shape[-1] if inputs and inputs[0].shape else 1
        return 2.0 * out_elems * k
    if primitive in ATTENTION:
        q, k = inputs[0].shape, inputs[1].shape  # [B, H, L, D], [B, Hk, S, D]
        return 4.0 * math.prod(q) * k[-2]
    if primitive in FIVE_PASS:
        return 5.0 * math.prod(inputs[0].shape)
    if primitive in REDUCTION:
        return float(math.prod(inputs[0].shape))
    if primitive in GATHER or primitive in KV_UPDATE or primitive in COPY:
        return 0.0
    return float(out_elems)


def op_cost(op: Op, values: PhaseValues) -> OpCost:
    """The roofline cost of one op of the phase ``values`` was built from."""
    if (
        op.primitive not in KV_UPDATE
        and op.primitive not in DONATING
        and op.outputs
        and all(map(values.is_view, op.outputs))
    ):
        return VIEW  # most ops of a phase: decided without building their values
    ins = [values.value(i) for i in op.inputs]
    outs = [values.value(o) for o in op.outputs]
    cls = op_class(op.primitive, outs)
    if cls == "view":
        return OpCost(cls, 0.0)
    moved = dict.fromkeys(BYTE_KINDS, 0)
    if cls == "kv update":
        # [source, update, offsets...]: in place when the output aliases the source.
        in_place = bool(outs) and outs[0].is_view
        update = ins[1].read_bytes if len(ins) > 1 else 0
        if in_place:
            moved[outs[0].kind] += update  # the written slice
        else:
            moved[ins[0].kind] += ins[0].read_bytes
            moved["activations"] += sum(o.logical_bytes for o in outs)
        for v in ins[1:]:
            moved[v.kind] += v.read_bytes
    else:
        if cls == "gather":  # only the gathered part of the source is read
            src, rest = ins[:1], ins[1:]
            gathered = math.prod(outs[0].shape) if outs else 0
            for v in src:
                moved[v.kind] += min(v.read_bytes, gathered * ITEMSIZE[v.dtype])
        else:
            rest = ins
        for v in rest:
            moved[v.kind] += v.read_bytes
        for o in outs:
            if not o.is_view or op.primitive in DONATING:  # written in place, but written
                moved["activations"] += o.logical_bytes
    moved["scratch"] = 2 * op.scratch
    return OpCost(cls, op_flops(op.primitive, ins, outs), **moved)


VIEW = OpCost("view", 0.0)


def phase_costs(phase: Phase) -> list[OpCost]:
    values = PhaseValues(phase)
    return [op_cost(op, values) for op in phase.ops]
