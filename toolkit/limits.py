"""Range checks for every number the compiler takes, before any of it reaches MLX or numpy.

MLX shapes are 32-bit and its Python binding raises OverflowError (or a multi-line nanobind
message) past them; a zero dimension divides by zero in mlx-lm's model code; a million layers grow
the trace past the machine's memory. Each limit below is far beyond any released model and far
below those failures; a value outside one is refused in one line that names the key and the range.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import Any

from dctms.schema.errors import DctmsError, short_value

MAX_TOKENS = 2**24  # N, M and N + M: 16.7M positions
MAX_BATCH = 1024
MAX_ALIGNMENT = 2**20  # 1 MiB; Metal pages are 16 KiB
MAX_LAYERS = 512  # the largest released decoders have ~130
MAX_DIMENSION = 2**20  # hidden, intermediate, heads, head_dim
MAX_VOCAB = 2**24
MAX_CONFIG_DEPTH = 32  # real configs nest 3 levels
MAX_CONFIG_FLOAT = 1e30  # rope_theta is ~1e4..1e8, norm epsilons ~1e-6

# config.json keys that are dimensions (>= 1) and their upper limits.
CONFIG_DIMENSIONS = {
    "hidden_size": MAX_DIMENSION,
    "intermediate_size": MAX_DIMENSION,
    "num_attention_heads": MAX_DIMENSION,
    "num_key_value_heads": MAX_DIMENSION,
    "head_dim": MAX_DIMENSION,
    "moe_intermediate_size": MAX_DIMENSION,
    "num_experts": MAX_DIMENSION,
    "num_local_experts": MAX_DIMENSION,
    "num_experts_per_tok": MAX_DIMENSION,
    "vocab_size": MAX_VOCAB,
    "num_hidden_layers": MAX_LAYERS,
    "max_position_embeddings": 2**31 - 1,
    "sliding_window": 2**31 - 1,
}
# Positive finite floats.
CONFIG_POSITIVE_FLOATS = ("rms_norm_eps", "layer_norm_eps", "norm_eps", "rope_theta")
# What MLX's affine quantisation supports.
QUANT_BITS = (2, 3, 4, 5, 6, 8)
QUANT_GROUP_SIZES = (32, 64, 128)


def check_count(name: str, value: int, low: int, high: int) -> None:
    """``low <= value <= high`` for an integer option or field, else one line naming both."""
    if type(value) is not int:
        raise DctmsError(f"{name} must be an integer, got {short_value(value)}")
    if not low <= value <= high:
        raise DctmsError(f"{name} must be between {low:,} and {high:,}, got {short_value(value)}")


def check_config(config: dict[str, Any]) -> None:
    """Refuse a config.json whose numbers no model could have (see the module docstring)."""
    model_type = config.get("model_type")
    if not isinstance(model_type, str) or not model_type.strip():
        raise DctmsError(f"config.json: model_type must be a name, got {model_type!r}")
    for where, section in _sections(config):
        heads, kv_heads = section.get("num_attention_heads"), section.get("num_key_value_heads")
        hidden = section.get("hidden_size")
        if "head_dim" not in section and type(hidden) is int and type(heads) is int and heads:
            if hidden % heads:
                raise DctmsError(
                    f"config.json: {where}hidden_size {hidden} is not a multiple of "
                    f"num_attention_heads {heads} (and no head_dim is given)"
                )
        if type(heads) is int and type(kv_heads) is int and kv_heads and heads % kv_heads:
            raise DctmsError(
                f"config.json: {where}num_attention_heads {heads} is not a multiple of "
                f"num_key_value_heads {kv_heads}"
            )
    for key in ("torch_dtype", "dtype"):
        value = config.get(key)
        if value is not None and not isinstance(value, str):
            raise DctmsError(f"config.json: {key} must be a dtype name, got {short_value(value)}")
    depth = _depth(config)
    if depth > MAX_CONFIG_DEPTH:
        raise DctmsError(f"config.json nests {depth} levels deep (at most {MAX_CONFIG_DEPTH})")
    for where, section in _sections(config):
        for key, high in CONFIG_DIMENSIONS.items():
            if key in section and section[key] is not None:
                value = section[key]
                if type(value) is not int:
                    raise DctmsError(
                        f"config.json: {where}{key} must be an integer, got {short_value(value)}"
                    )
                if not 1 <= value <= high:
                    raise DctmsError(
                        f"config.json: {where}{key} must be between 1 and {high:,}, got {short_value(value)}"
                        + (
                            " (dctms plans at most that many layers)"
                            if key == "num_hidden_layers"
                            else ""
                        )
                    )
        for key in CONFIG_POSITIVE_FLOATS:
            value = section.get(key)
            if value is None:
                continue
            # compared, not converted: an integer of 400 digits has no float
            finite = type(value) is int or (type(value) is float and math.isfinite(value))
            if not finite or not 0 < value <= MAX_CONFIG_FLOAT:
                raise DctmsError(
                    f"config.json: {where}{key} must be a positive number of at most "
                    f"{MAX_CONFIG_FLOAT:g}, got {short_value(value)}"
                )
    for key in ("quantization", "quantization_config"):
        quant = config.get(key)
        if quant is None:
            continue
        if not isinstance(quant, dict):
            raise DctmsError(f"config.json: {key} must be an object, got {short_value(quant)}")
        if "bits" not in quant and "group_size" not in quant:
            continue  # another library's quantisation record: mlx-lm ignores it, so do we
        bits, group = quant.get("bits"), quant.get("group_size")
        if type(bits) is not int or bits not in QUANT_BITS:
            raise DctmsError(
                f"config.json: {key}.bits must be one of {', '.join(map(str, QUANT_BITS))}, "
                f"got {short_value(bits)}"
            )
        if type(group) is not int or group not in QUANT_GROUP_SIZES:
            raise DctmsError(
                f"config.json: {key}.group_size must be one of "
                f"{', '.join(map(str, QUANT_GROUP_SIZES))}, got {short_value(group)}"
            )
        mode = quant.get("mode", "affine")
        if not isinstance(mode, str):
            raise DctmsError(f"config.json: {key}.mode must be a string, got {short_value(mode)}")


def _sections(config: dict[str, Any]) -> Iterator[tuple[str, dict[str, Any]]]:
    """The config and the nested model configs multimodal checkpoints carry."""
    yield "", config
    for key in ("text_config", "language_config", "llm_config"):
        section = config.get(key)
        if isinstance(section, dict):
            yield f"{key}.", section


def _depth(value: Any) -> int:
    # Iterative: a deeply nested document must not overflow the stack here either.
    deepest, stack = 0, [(value, 1)]
    while stack:
        item, level = stack.pop()
        if isinstance(item, dict):
            children = item.values()
        elif isinstance(item, list):
            children = item
        else:
            continue
        deepest = max(deepest, level)
        if level > MAX_CONFIG_DEPTH:
            return level
        stack.extend((child, level + 1) for child in children)
    return deepest


def check_options(opts: Any) -> None:
    """Upper limits of the compile options (``CompileOptions``; the lower ones are the compiler's
    own checks): a plan past them could not be traced, or not by MLX's 32-bit shapes."""
    for name, value, high in (
        ("input tokens (-N)", opts.input_tokens, MAX_TOKENS),
        ("output tokens (-M)", opts.output_tokens, MAX_TOKENS),
        ("batch", opts.batch, MAX_BATCH),
        ("prefill chunk", opts.prefill_chunk, MAX_TOKENS),
        ("alignment", opts.alignment, MAX_ALIGNMENT),
        ("--sync-every", opts.sync_every, MAX_LAYERS),
        ("--token-step", getattr(opts, "token_step", None), MAX_TOKENS),
        ("--window-step", getattr(opts, "window_step", None), MAX_TOKENS),
    ):
        if value is None:
            continue
        if type(value) is not int:
            raise DctmsError(f"{name} must be an integer, got {short_value(value)}")
        if value > high:
            raise DctmsError(f"{name} must be at most {high:,}, got {short_value(value)}")
    if opts.input_tokens + opts.output_tokens > MAX_TOKENS:
        raise DctmsError(
            f"N + M must be at most {MAX_TOKENS:,} positions, got "
            f"{opts.input_tokens:,} + {opts.output_tokens:,}"
        )
