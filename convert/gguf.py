"""``convert-gguf``: a llama.cpp GGUF file -> an mlx-lm model folder.

MLX reads GGUF itself (``mx.load(path, return_metadata=True)``): Q4_0/Q4_1/Q8_0 tensors arrive as
MLX's affine quantised triplets (weight, scales, biases; group size 32), F32/F16 as plain arrays, and
the metadata as a dict. This module names the tensors as mlx-lm's ``llama`` model does, undoes
llama.cpp's row permutation of the q/k projections (its converter interleaves each head's two RoPE
halves), writes ``config.json`` from the metadata and builds ``tokenizer.json`` with the
``tokenizers`` library's own BPE model from the GGUF vocabulary and merges.

Supported: architecture ``llama`` (SmolLM, Llama 2-style checkpoints with a GPT-2 byte-level BPE
vocabulary), tensor types F32, F16, Q4_0, Q4_1, Q8_0. Anything else is refused in one line naming it.
"""

from __future__ import annotations

import json
import shutil
import tempfile
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import mlx.core as mx

from dctms.convert.gguf_check import GLOBAL_TENSORS, LAYER_NAME, LAYER_TENSORS, check_llama
from dctms.convert.gguf_header import read_header
from dctms.schema.errors import DctmsError

TENSOR_TYPES = ("F32", "F16", "Q4_0", "Q4_1", "Q8_0")
OUT_DTYPES = ("keep", "float32", "float16", "bfloat16")
GROUP_SIZE = 32  # every GGUF block type MLX converts has 32 weights per block

# llama.cpp's pre-tokenizer names whose splitting the tokenizers library reproduces exactly:
# "gpt2"/"default": GPT-2's regex; the starcoder family (SmolLM among them): each digit alone,
# then GPT-2's regex (llama-vocab.cpp's regex lists for these types).
_PRE_TOKENIZERS = {"default": False, "gpt2": False, "gpt-2": False}
_PRE_TOKENIZERS.update(dict.fromkeys(("smollm", "starcoder", "refact", "codeshell"), True))

# GGUF token types (llama.cpp's llama_token_type): 3 control, 4 user-defined.
_CONTROL, _USER_DEFINED = 3, 4


def convert_gguf(
    source: str | Path,
    out: str | Path,
    dtype: str = "keep",
    progress: Callable[[str], None] | None = None,
) -> Path:
    """Write an mlx-lm folder for ``source`` at ``out`` (which must not exist or be empty)."""
    say = progress or (lambda _m: None)
    src, dst = Path(source), Path(out)
    if dtype not in OUT_DTYPES:
        raise DctmsError(f"--dtype must be one of {', '.join(OUT_DTYPES)}, got {dtype}")
    if not src.is_file():
        raise DctmsError(f"{src}: no such file")
    if dst.exists() and (not dst.is_dir() or any(dst.iterdir())):
        raise DctmsError(f"{dst}: already exists and is not an empty folder; choose a new OUT")
    # The whole header is checked before MLX reads the file (its reader trusts every length and
    # offset) and before anything is written: a refused file writes nothing.
    head = read_header(src)
    other = sorted({t.type_name for t in head.tensors} - set(TENSOR_TYPES))
    if other:
        first = next(t.name for t in head.tensors if t.type_name == other[0])
        raise DctmsError(
            f"{src}: tensor type {', '.join(other)} (e.g. {first}) is not supported; "
            f"convert-gguf reads {', '.join(TENSOR_TYPES)}"
        )
    check_llama(head, src)
    say(f"reading {src.name} ({src.stat().st_size / 2**20:.1f} MiB)")
    try:
        tensors, meta = mx.load(str(src), return_metadata=True)
    except (RuntimeError, ValueError, OSError) as err:
        raise DctmsError(f"{src}: MLX cannot read it: {err}") from None
    config = llama_config(meta, tensors, src)
    weights = llama_weights(tensors, config, dtype, src)
    config.update(_weights_config(weights, dtype))
    tokenizer, tokenizer_config = build_tokenizer(meta, src)
    say(f"writing {len(weights)} tensors ({_dtype_words(weights, dtype)}) to {dst}")
    _write_folder(dst, config, weights, tokenizer, tokenizer_config)
    return dst


# ------------------------------------------------------------------------------------ config


def _text(meta: dict, key: str, src: Path) -> str:
    value = meta.get(key)
    if not isinstance(value, str):
        raise DctmsError(f"{src}: GGUF metadata lacks {key}")
    return value


def _number(meta: dict, key: str, src: Path, default: float | None = None) -> float:
    value = meta.get(key)
    if value is None:
        if default is None:
            raise DctmsError(f"{src}: GGUF metadata lacks {key}")
        return default
    if not isinstance(value, mx.array) or value.ndim != 0:
        raise DctmsError(f"{src}: GGUF metadata {key} is not a number")
    return value.item()


def llama_config(meta: dict, tensors: dict, src: Path) -> dict:
    """mlx-lm's ``llama`` config.json from the GGUF metadata (``llama.*`` keys)."""
    p = "llama."
    for key in (p + "rope.scaling.type", p + "rope.scaling.factor"):
        kind = meta.get(key)
        if kind is not None and kind != "none":
            raise DctmsError(f"{src}: RoPE scaling ({key} = {kind}) is not supported")
    # check_llama has checked every value and its consistency with the tensors.
    hidden = int(_number(meta, p + "embedding_length", src))
    heads = int(_number(meta, p + "attention.head_count", src))
    kv_heads = int(_number(meta, p + "attention.head_count_kv", src, heads))
    head_dim = int(_number(meta, p + "attention.key_length", src, hidden // heads))
    tokens = meta.get("tokenizer.ggml.tokens")
    vocab = int(_number(meta, p + "vocab_size", src, len(tokens) if tokens else None))
    config = {
        "model_type": "llama",
        "architectures": ["LlamaForCausalLM"],
        "hidden_size": hidden,
        "num_hidden_layers": int(_number(meta, p + "block_count", src)),
        "intermediate_size": int(_number(meta, p + "feed_forward_length", src)),
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": head_dim,
        "rms_norm_eps": _float32(_number(meta, p + "attention.layer_norm_rms_epsilon", src)),
        "rope_theta": _float32(_number(meta, p + "rope.freq_base", src, 10000.0)),
        "max_position_embeddings": int(_number(meta, p + "context_length", src, 4096)),
        "vocab_size": vocab,
        "tie_word_embeddings": "output.weight" not in tensors,
        "attention_bias": False,
        "mlp_bias": False,
    }
    for name, key in (("bos_token_id", "bos_token_id"), ("eos_token_id", "eos_token_id")):
        value = meta.get(f"tokenizer.ggml.{key}")
        if isinstance(value, mx.array):
            config[name] = int(value.item())
    return config


def _float32(x: float) -> float:
    """GGUF stores these as float32: written back as the shortest decimal of that float32
    (1e-05, not 9.999999747378752e-06), the value the checkpoint's config had."""
    return float(f"{x:.7g}")


# ------------------------------------------------------------------------------------ weights


def llama_weights(tensors: dict, config: dict, dtype: str, src: Path) -> dict[str, mx.array]:
    """The tensors under mlx-lm's names, q/k rows un-permuted, dequantised unless ``keep``."""
    grouped: dict[str, dict[str, mx.array]] = {}
    for name, array in tensors.items():
        base, _, part = name.rpartition(".")
        grouped.setdefault(_mlx_name(base, src), {})[part] = array
    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    out: dict[str, mx.array] = {}
    for path, parts in sorted(grouped.items()):
        if path.endswith("self_attn.q_proj"):
            parts = {k: unpermute_rows(v, heads) for k, v in parts.items()}
        elif path.endswith("self_attn.k_proj"):
            parts = {k: unpermute_rows(v, kv_heads) for k, v in parts.items()}
        if "scales" in parts and dtype != "keep":
            target = getattr(mx, dtype)
            w = mx.dequantize(
                parts["weight"],
                parts["scales"].astype(mx.float32),
                parts["biases"].astype(mx.float32),
                group_size=GROUP_SIZE,
                bits=_bits(parts),
            )
            parts = {"weight": w.astype(target)}
        elif dtype != "keep":
            parts = {k: v.astype(getattr(mx, dtype)) for k, v in parts.items()}
        for part, array in parts.items():
            out[f"{path}.{part}"] = array
    return out


def _mlx_name(base: str, src: Path) -> str:
    if base in GLOBAL_TENSORS:
        return GLOBAL_TENSORS[base]
    m = LAYER_NAME.match(base)
    if m and m.group(2) in LAYER_TENSORS:
        return f"model.layers.{m.group(1)}.{LAYER_TENSORS[m.group(2)]}"
    raise DctmsError(f"{src}: tensor {base} is not one of a llama model")


def unpermute_rows(w: mx.array, heads: int) -> mx.array:
    """Undo llama.cpp's q/k permutation: per head it stores rows (i, half) at i * 2 + half where
    the Hugging Face layout (mlx-lm's, non-traditional RoPE) has them at half * head_dim/2 + i.
    Works on a quantised triplet's parts alike, since all of them are indexed by output row."""
    rows = w.shape[0]
    return w.reshape(heads, rows // heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _bits(parts: dict[str, mx.array]) -> int:
    columns = parts["scales"].shape[-1] * GROUP_SIZE
    return parts["weight"].shape[-1] * 32 // columns


def _weights_config(weights: dict[str, mx.array], dtype: str) -> dict:
    """``torch_dtype`` and, for quantised layers kept as they are, mlx-lm's ``quantization``
    block: the most common bit width as the default, other widths as per-layer entries."""
    if dtype != "keep":
        return {"torch_dtype": dtype}
    bits = {
        name.removesuffix(".scales"): weights[name.removesuffix(".scales") + ".weight"].shape[-1]
        * 32
        // (weights[name].shape[-1] * GROUP_SIZE)
        for name in weights
        if name.endswith(".scales")
    }
    floats = Counter(
        str(a.dtype).removeprefix("mlx.core.")
        for a in weights.values()
        if mx.issubdtype(a.dtype, mx.floating)
    )
    extra: dict = {"torch_dtype": floats.most_common(1)[0][0] if floats else "float16"}
    if bits:
        common = Counter(bits.values()).most_common(1)[0][0]
        quant: dict = {"group_size": GROUP_SIZE, "bits": common, "mode": "affine"}
        for path, b in sorted(bits.items()):
            if b != common:
                quant[path] = {"group_size": GROUP_SIZE, "bits": b, "mode": "affine"}
        extra["quantization"] = quant
    return extra


def _dtype_words(weights: dict[str, mx.array], dtype: str) -> str:
    if dtype != "keep":
        return f"dequantised to {dtype}"
    return "quantised layers kept" if any(n.endswith(".scales") for n in weights) else "as stored"


# ------------------------------------------------------------------------------------ tokenizer


def build_tokenizer(meta: dict, src: Path) -> tuple[str, dict]:
    """tokenizer.json (as text) and tokenizer_config.json for a GGUF ``gpt2`` (byte-level BPE)
    vocabulary, built with the tokenizers library's BPE model."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors

    kind = meta.get("tokenizer.ggml.model")
    if kind != "gpt2":
        raise DctmsError(
            f"{src}: tokenizer model {kind} is not supported (convert-gguf builds gpt2 byte-level BPE)"
        )
    pre = meta.get("tokenizer.ggml.pre", "default")
    if pre not in _PRE_TOKENIZERS:
        raise DctmsError(f"{src}: pre-tokenizer {pre} is not supported yet")
    tokens = meta.get("tokenizer.ggml.tokens")
    merges = meta.get("tokenizer.ggml.merges") or []
    if not isinstance(tokens, list) or not tokens:
        raise DctmsError(f"{src}: GGUF metadata lacks the vocabulary (tokenizer.ggml.tokens)")
    types = meta.get("tokenizer.ggml.token_type")
    types = types.tolist() if isinstance(types, mx.array) else [1] * len(tokens)
    vocab = {t: i for i, t in enumerate(tokens)}
    pairs = [tuple(m.split(" ", 1)) for m in merges]
    try:
        bpe = models.BPE(vocab=vocab, merges=pairs, fuse_unk=False, byte_fallback=False)
    except Exception as err:  # the tokenizers library raises its own exception type
        raise DctmsError(
            f"{src}: the GGUF vocabulary does not make a BPE tokenizer: {err}"
        ) from None
    tok = Tokenizer(bpe)
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if _PRE_TOKENIZERS[pre]:
        tok.pre_tokenizer = pre_tokenizers.Sequence(
            [pre_tokenizers.Digits(individual_digits=True), byte_level]
        )
    else:
        tok.pre_tokenizer = byte_level
    tok.decoder = decoders.ByteLevel()
    special = [
        AddedToken(tokens[i], special=True, normalized=False)
        for i, t in enumerate(types)
        if t == _CONTROL
    ]
    user = [
        AddedToken(tokens[i], special=False, normalized=False)
        for i, t in enumerate(types)
        if t == _USER_DEFINED
    ]
    tok.add_special_tokens(special)
    if user:
        tok.add_tokens(user)

    def token_of(key: str) -> str | None:
        value = meta.get(f"tokenizer.ggml.{key}_token_id")
        if isinstance(value, mx.array) and 0 <= int(value.item()) < len(tokens):
            return tokens[int(value.item())]
        return None

    bos = token_of("bos")
    add_bos = (
        bool(meta["tokenizer.ggml.add_bos_token"].item())
        if isinstance(meta.get("tokenizer.ggml.add_bos_token"), mx.array)
        else False
    )
    byte_post = processors.ByteLevel(trim_offsets=False)
    if add_bos and bos is not None:
        tok.post_processor = processors.Sequence(
            [
                byte_post,
                processors.TemplateProcessing(
                    single=f"{bos}:0 $A:0",
                    pair=f"{bos}:0 $A:0 {bos}:1 $B:1",
                    special_tokens=[(bos, vocab[bos])],
                ),
            ]
        )
    else:
        tok.post_processor = byte_post
    tokenizer_config: dict = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "add_bos_token": add_bos,
        "add_prefix_space": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": int(_number(meta, "llama.context_length", src, 4096)),
    }
    # llama.cpp's key names -> transformers' (tokenizer.ggml.unknown_token_id, not unk_...)
    for key, name in (("bos", "bos"), ("eos", "eos"), ("unknown", "unk"), ("padding", "pad")):
        value = token_of(key)
        if value is not None:
            tokenizer_config[f"{name}_token"] = value
    template = meta.get("tokenizer.chat_template")
    if isinstance(template, str) and template:
        tokenizer_config["chat_template"] = template
    return tok.to_str(), tokenizer_config


# ------------------------------------------------------------------------------------ writing


def _write_folder(
    dst: Path, config: dict, weights: dict, tokenizer: str, tokenizer_config: dict
) -> None:
    """Everything into a temporary folder beside ``dst``, renamed into place at the end: an
    interrupted conversion leaves no half-written model behind."""
    dst.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{dst.name}.", dir=dst.parent))
    try:
        mx.save_safetensors(str(tmp / "model.safetensors"), weights, metadata={"format": "mlx"})
        (tmp / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
        (tmp / "tokenizer.json").write_text(tokenizer, encoding="utf-8")
        (tmp / "tokenizer_config.json").write_text(
            json.dumps(tokenizer_config, indent=2, sort_keys=True, ensure_ascii=False) + "\n",
            encoding="utf-8",
        )
        tmp.chmod(0o755)  # mkdtemp makes it private; a model folder is an ordinary folder
        if dst.exists():
            dst.rmdir()  # empty (checked before converting)
        tmp.rename(dst)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
