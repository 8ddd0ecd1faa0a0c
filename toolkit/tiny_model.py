"""Tiny local models with random weights, written exactly as mlx-lm's ``convert`` would write them.

Used by ``dctms demo`` and the tests: nothing is downloaded. The folder holds ``config.json``,
``model.safetensors`` (cast to the config's dtype, quantised if the config says so) and a
byte-level ``tokenizer.json`` (256 byte tokens + an end-of-text token).
"""

from __future__ import annotations

import json
from pathlib import Path

import mlx.core as mx
from mlx.utils import tree_flatten, tree_unflatten

from dctms.toolkit.trace import build_model, quantize_like_mlx_lm

SPREAD = 4.0  # weight scale of the random projections (see write_tiny_model)

DEMO_CONFIG = {
    "model_type": "qwen2",
    "hidden_size": 128,
    "num_hidden_layers": 4,
    "intermediate_size": 352,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 257,
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0,
    "max_position_embeddings": 4096,
    "tie_word_embeddings": True,
    "torch_dtype": "float32",
    "eos_token_id": 256,
}


def write_tiny_model(folder: Path, config: dict, seed: int = 0, tokenizer: bool = True) -> Path:
    """Create ``folder`` with config, random weights and (optionally) a byte-level tokenizer."""
    folder.mkdir(parents=True, exist_ok=True)
    mx.random.seed(seed)
    dtype = config.get("torch_dtype", "float32")
    plain = {k: v for k, v in config.items() if k != "quantization"}
    model = build_model(plain, dtype)
    # mlx-lm's default initialisation gives a tiny random model that repeats one token forever;
    # widening the projections makes greedy outputs varied, so fidelity tests compare real sequences.
    model.update(
        tree_unflatten(
            [
                (k, v * SPREAD if v.ndim == 2 and "embed" not in k else v)
                for k, v in tree_flatten(model.parameters())
            ]
        )
    )
    if "quantization" in config:
        quantize_like_mlx_lm(model, config["quantization"], None)
    weights = dict(tree_flatten(model.parameters()))
    mx.eval(list(weights.values()))
    tmp = folder / "model.safetensors.tmp.safetensors"
    mx.save_safetensors(str(tmp), weights, metadata={"format": "mlx"})
    tmp.replace(folder / "model.safetensors")
    (folder / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    if tokenizer:
        write_byte_tokenizer(folder / "tokenizer.json", eos_id=config.get("eos_token_id"))
    return folder


def write_byte_tokenizer(path: Path, eos_id: int | None = None) -> None:
    """A byte-level BPE with no merges: every UTF-8 byte is one token (ids 0..255)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    byte_chars = _bytes_to_unicode()
    vocab = {byte_chars[b]: b for b in range(256)}
    assert set(vocab) == set(alphabet)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    if eos_id is not None:
        from tokenizers import AddedToken

        tok.add_special_tokens([AddedToken("<|endoftext|>", special=True)])
    tok.save(str(path))


def _bytes_to_unicode() -> dict[int, str]:
    # GPT-2's reversible byte <-> printable character table, as ByteLevel uses it.
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
    bs += list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {b: chr(c) for b, c in zip(bs, cs, strict=True)}
