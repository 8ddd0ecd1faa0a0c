"""A llama GGUF header's hyperparameters, checked against each other and against the tensors' real
shapes before the converter reads any weight or writes anything.

Every count and dimension must be a positive integer, the heads must divide as attention needs
(``head_count_kv`` divides ``head_count``, every projection's rows are heads x head dimension), the
layers the tensors hold must be exactly ``block_count``, every norm weight a vector of
``embedding_length``, the epsilon and RoPE base finite and positive, and the vocabulary the same
size as the embedding. Each refusal is one line naming the key or tensor and its value.
"""

from __future__ import annotations

import math
import re
from pathlib import Path

from dctms.convert.gguf_header import (
    ARRAY,
    BOOL,
    F64,
    FLOAT_TYPES,
    INTEGER_TYPES,
    STRING,
    GgufHeader,
    GgufTensor,
    GgufValue,
)
from dctms.schema.errors import DctmsError

ARCHITECTURES = ("llama",)
MAX_CONTEXT = 2**31 - 1  # positions are int32 in MLX
_UNQUANTISED = ("F32", "F16")

# A llama model's GGUF tensor names -> mlx-lm parameter paths: the whole-model ones, then the
# ones of each layer (under blk.N. in GGUF, model.layers.N. in mlx-lm).
GLOBAL_TENSORS = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}
LAYER_TENSORS = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
LAYER_NAME = re.compile(r"^blk\.(0|[1-9][0-9]*)\.(\w+)$")


def check_llama(head: GgufHeader, src: Path) -> None:
    """Refuse (``DctmsError``) a header mlx-lm's ``llama`` model could not be built from."""
    meta = head.metadata
    arch = _text(meta, "general.architecture", src)
    if arch not in ARCHITECTURES:
        raise DctmsError(
            f"{src}: architecture {arch} is not supported; convert-gguf converts "
            f"{', '.join(ARCHITECTURES)}"
        )
    _check_types(meta, src)
    tensors = {t.name: t for t in head.tensors}
    layers = _tensor_names(tensors, src)
    p = "llama."
    hidden = _count(meta, p + "embedding_length", src)
    heads = _count(meta, p + "attention.head_count", src)
    kv_heads = _count(meta, p + "attention.head_count_kv", src, default=heads)
    if heads % kv_heads:
        raise DctmsError(
            f"{src}: {p}attention.head_count_kv = {kv_heads} does not divide "
            f"{p}attention.head_count = {heads}"
        )
    head_dim = _head_dim(meta, hidden, heads, src)
    rope_dims = _count(meta, p + "rope.dimension_count", src, default=head_dim)
    if rope_dims != head_dim:
        raise DctmsError(f"{src}: partial RoPE ({rope_dims} of {head_dim} dims) is not supported")
    blocks = _count(meta, p + "block_count", src)
    ff = _count(meta, p + "feed_forward_length", src)
    _count(meta, p + "context_length", src, default=1, high=MAX_CONTEXT)
    _positive_real(meta, p + "attention.layer_norm_rms_epsilon", src)
    _positive_real(meta, p + "rope.freq_base", src, default=10000.0)
    _check_layers(layers, blocks, src)

    vocab = _vocabulary(meta, tensors, hidden, src)
    q_rows, kv_rows = heads * head_dim, kv_heads * head_dim
    q_why = f"{p}attention.head_count = {heads} x head dimension {head_dim}"
    kv_why = f"{p}attention.head_count_kv = {kv_heads} x head dimension {head_dim}"
    h_why = f"{p}embedding_length = {hidden}"
    f_why = f"{p}feed_forward_length = {ff}"
    expected = {
        "token_embd.weight": ((vocab, hidden), h_why),
        "output_norm.weight": ((hidden,), h_why),
        "output.weight": ((vocab, hidden), h_why),
    }
    for i in range(blocks):
        b = f"blk.{i}."
        expected.update(
            {
                b + "attn_norm.weight": ((hidden,), h_why),
                b + "ffn_norm.weight": ((hidden,), h_why),
                b + "attn_q.weight": ((q_rows, hidden), q_why),
                b + "attn_k.weight": ((kv_rows, hidden), kv_why),
                b + "attn_v.weight": ((kv_rows, hidden), kv_why),
                b + "attn_output.weight": ((hidden, q_rows), q_why),
                b + "ffn_gate.weight": ((ff, hidden), f_why),
                b + "ffn_up.weight": ((ff, hidden), f_why),
                b + "ffn_down.weight": ((hidden, ff), f_why),
            }
        )
    for name, (shape, why) in expected.items():
        if name in tensors:
            _check_tensor(tensors[name], shape, why, src)
    _check_token_ids(meta, vocab, src)


# ------------------------------------------------------------------------------------ tensors


def _tensor_names(tensors: dict[str, GgufTensor], src: Path) -> dict[int, set[str]]:
    """The layer tensors present, by layer; refuses a name that is not a llama model's."""
    if "rope_freqs.weight" in tensors:
        raise DctmsError(f"{src}: RoPE frequency factors (rope_freqs) are not supported")
    layers: dict[int, set[str]] = {}
    for name in tensors:
        base, _, part = name.rpartition(".")
        if part == "bias":
            raise DctmsError(f"{src}: tensor {name}: projection biases are not supported (llama)")
        if part != "weight":
            raise DctmsError(f"{src}: tensor {name} is not one convert-gguf knows")
        m = LAYER_NAME.match(base)
        if base in GLOBAL_TENSORS:
            continue
        if not m or m.group(2) not in LAYER_TENSORS:
            raise DctmsError(f"{src}: tensor {base} is not one of a llama model")
        layers.setdefault(int(m.group(1)), set()).add(m.group(2))
    for name in ("token_embd", "output_norm"):
        if f"{name}.weight" not in tensors:
            raise DctmsError(f"{src}: the file lacks {name}.weight")
    return layers


def _check_layers(layers: dict[int, set[str]], blocks: int, src: Path) -> None:
    beyond = [i for i in layers if i >= blocks]
    if beyond:
        raise DctmsError(
            f"{src}: tensor blk.{min(beyond)}.* is layer {min(beyond)}, but "
            f"llama.block_count = {blocks} (layers 0 to {blocks - 1})"
        )
    held = sum(len(parts) for parts in layers.values())
    if held < blocks * len(LAYER_TENSORS):
        first = next(i for i in range(blocks) if len(layers.get(i, ())) < len(LAYER_TENSORS))
        part = next(t for t in LAYER_TENSORS if t not in layers.get(first, ()))
        raise DctmsError(
            f"{src}: llama.block_count = {blocks}, but the file lacks blk.{first}.{part}.weight "
            f"({blocks * len(LAYER_TENSORS) - held} layer tensors missing)"
        )


def _check_tensor(t: GgufTensor, shape: tuple[int, ...], why: str, src: Path) -> None:
    if t.shape != shape:
        raise DctmsError(
            f"{src}: tensor {t.name} has shape {list(t.shape)}, expected {list(shape)} ({why})"
        )
    if len(shape) == 1 and t.type_name not in _UNQUANTISED:
        raise DctmsError(f"{src}: tensor {t.name} is {t.type_name}; a norm weight is F32 or F16")


def _vocabulary(meta: dict, tensors: dict[str, GgufTensor], hidden: int, src: Path) -> int:
    """The vocabulary size: the embedding's rows, which the token list and vocab_size match."""
    rows = tensors["token_embd.weight"].shape[0]
    tokens = meta.get("tokenizer.ggml.tokens")
    if tokens is None or tokens.item_type != STRING or not tokens.value:
        raise DctmsError(f"{src}: GGUF metadata lacks the vocabulary (tokenizer.ggml.tokens)")
    if len(tokens.value) != rows:
        raise DctmsError(
            f"{src}: tokenizer.ggml.tokens holds {len(tokens.value)} tokens, but "
            f"token_embd.weight has {rows} rows"
        )
    vocab = _count(meta, "llama.vocab_size", src, default=rows)
    if vocab != rows:
        raise DctmsError(
            f"{src}: llama.vocab_size = {vocab}, but token_embd.weight has {rows} rows"
        )
    types = meta.get("tokenizer.ggml.token_type")
    if types is not None and (types.item_type not in INTEGER_TYPES or len(types.value) != rows):
        raise DctmsError(
            f"{src}: tokenizer.ggml.token_type is not {rows} integers (one per token): "
            f"{types.type_name} of {len(types.value) if types.item_type is not None else 1}"
        )
    return rows


def _check_token_ids(meta: dict, vocab: int, src: Path) -> None:
    for key in ("bos", "eos", "unknown", "padding"):
        name = f"tokenizer.ggml.{key}_token_id"
        if name in meta:
            _count(meta, name, src, low=0, high=vocab - 1)


# ------------------------------------------------------------------------------------ values


# The other keys the converter reads, and the one type each may have (the llama counts and reals
# are checked by _count and _positive_real).
_TYPES = {
    "tokenizer.ggml.model": (STRING, None),
    "tokenizer.ggml.pre": (STRING, None),
    "tokenizer.chat_template": (STRING, None),
    "tokenizer.ggml.merges": (ARRAY, STRING),
    "tokenizer.ggml.add_bos_token": (BOOL, None),
    "llama.rope.scaling.type": (STRING, None),
}


def _check_types(meta: dict, src: Path) -> None:
    for key, entry in meta.items():
        if F64 in (entry.type, entry.item_type):
            # MLX's reader converts a float64 to float32 and then steps over 4 bytes, not 8: the
            # rest of the header is misread (a crash, issue 35's fuzzer found)
            raise DctmsError(
                f"{src}: {key} is a {entry.type_name} ({_short(entry.value)}); MLX's GGUF reader "
                "misreads float64 metadata"
            )
    for key, (kind, item) in _TYPES.items():
        entry = meta.get(key)
        if entry is not None and (entry.type, entry.item_type) != (kind, item):
            wanted = GgufValue(kind, None, item).type_name
            raise DctmsError(
                f"{src}: {key} is of type {entry.type_name} ({_short(entry.value)}), "
                f"expected {wanted}"
            )
    factor = meta.get("llama.rope.scaling.factor")
    if factor is not None and factor.type not in FLOAT_TYPES | INTEGER_TYPES:
        raise DctmsError(f"{src}: llama.rope.scaling.factor is a {factor.type_name}, not a number")


def _text(meta: dict, key: str, src: Path) -> str:
    entry = meta.get(key)
    if entry is None or entry.type != STRING:
        raise DctmsError(f"{src}: GGUF metadata lacks {key}")
    return entry.value


def _count(
    meta: dict, key: str, src: Path, default: int | None = None, low: int = 1, high: int | None = None
) -> int:
    """An integer metadata value in ``[low, high]`` (``default`` when absent, else required)."""
    entry = meta.get(key)
    if entry is None:
        if default is None:
            raise DctmsError(f"{src}: GGUF metadata lacks {key}")
        return default
    if entry.type not in INTEGER_TYPES:
        raise DctmsError(f"{src}: {key} is a {entry.type_name} ({_short(entry.value)}), not an integer")
    value = entry.value
    if value < low:
        raise DctmsError(f"{src}: {key} = {value} is {'not positive' if low == 1 else 'negative'}")
    if high is not None and value > high:
        raise DctmsError(f"{src}: {key} = {value} is above {high}")
    return value


def _positive_real(meta: dict, key: str, src: Path, default: float | None = None) -> float:
    entry = meta.get(key)
    if entry is None:
        if default is None:
            raise DctmsError(f"{src}: GGUF metadata lacks {key}")
        return default
    if entry.type not in FLOAT_TYPES | INTEGER_TYPES:
        raise DctmsError(f"{src}: {key} is a {entry.type_name} ({_short(entry.value)}), not a number")
    value = float(entry.value)
    if not math.isfinite(value) or value <= 0:
        raise DctmsError(f"{src}: {key} = {value} is not a finite positive number")
    return value


def _head_dim(meta: dict, hidden: int, heads: int, src: Path) -> int:
    p = "llama.attention."
    if p + "key_length" in meta:
        head_dim = _count(meta, p + "key_length", src)
    elif hidden % heads:
        raise DctmsError(
            f"{src}: {p}head_count = {heads} does not divide llama.embedding_length = {hidden} "
            f"(and {p}key_length is absent)"
        )
    else:
        head_dim = hidden // heads
    value_dim = _count(meta, p + "value_length", src, default=head_dim)
    if value_dim != head_dim:
        raise DctmsError(
            f"{src}: {p}value_length = {value_dim} differs from the key length {head_dim}"
        )
    if head_dim % 2:
        raise DctmsError(f"{src}: the head dimension {head_dim} is odd (RoPE rotates pairs)")
    return head_dim


def _short(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."
