"""``dctms convert-gguf`` on GGUF files written here with ``mx.save_gguf``.

A tiny random llama model is written the way llama.cpp's converter lays it out (GGUF tensor names,
q/k rows permuted for its RoPE), converted back, and must equal the original weight for weight and
give mlx-lm's greedy tokens. What the converter does not convert is refused in one line.
(The real SmolLM2 GGUF is exercised in test_real_model.py.)
"""

from __future__ import annotations

import json
import struct
import subprocess
import sys
from pathlib import Path

import mlx.core as mx
import pytest

from dctms.convert.gguf import convert_gguf
from dctms.schema.errors import DctmsError
from dctms.toolkit.tiny_model import _bytes_to_unicode, write_tiny_model

CONFIG = {
    "model_type": "llama",
    "hidden_size": 64,
    "num_hidden_layers": 2,
    "intermediate_size": 128,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 261,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "max_position_embeddings": 256,
    "torch_dtype": "float32",
}
_LAYER = {
    "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
    "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}  # fmt: skip


def llama_cpp_permute(w: mx.array, heads: int) -> mx.array:
    """llama.cpp convert_hf_to_gguf.py's ``permute`` of q/k rows (the inverse of ours)."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(
        w.shape
    )


def gguf_name(name: str) -> str:
    base, part = name.rsplit(".", 1)
    fixed = {"model.embed_tokens": "token_embd", "model.norm": "output_norm", "lm_head": "output"}
    if base in fixed:
        return f"{fixed[base]}.{part}"
    _, _, layer, rest = base.split(".", 3)
    return f"blk.{layer}.{_LAYER[rest]}.{part}"


def byte_vocab() -> list[str]:
    chars = _bytes_to_unicode()
    return [chars[b] for b in range(256)] + ["he", "ll", "hell", "<|im_start|>", "<|im_end|>"]


def write_gguf(path: Path, config: dict, weights: dict, **meta_overrides) -> Path:
    heads, kv = config["num_attention_heads"], config["num_key_value_heads"]
    tensors = {}
    for name, w in weights.items():
        if "q_proj" in name:
            w = llama_cpp_permute(w, heads)
        elif "k_proj" in name:
            w = llama_cpp_permute(w, kv)
        tensors[gguf_name(name)] = w
    u32 = lambda v: mx.array(v, dtype=mx.uint32)  # noqa: E731
    vocab = byte_vocab()
    meta = {
        "general.architecture": "llama",
        "llama.embedding_length": u32(config["hidden_size"]),
        "llama.block_count": u32(config["num_hidden_layers"]),
        "llama.feed_forward_length": u32(config["intermediate_size"]),
        "llama.attention.head_count": u32(heads),
        "llama.attention.head_count_kv": u32(kv),
        "llama.attention.layer_norm_rms_epsilon": mx.array(config["rms_norm_eps"]),
        "llama.rope.freq_base": mx.array(config["rope_theta"]),
        "llama.context_length": u32(config["max_position_embeddings"]),
        "llama.vocab_size": u32(len(vocab)),
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.pre": "smollm",
        "tokenizer.ggml.tokens": vocab,
        "tokenizer.ggml.merges": ["h e", "l l", "he ll"],
        "tokenizer.ggml.token_type": mx.array([1] * 259 + [3, 3], dtype=mx.int32),
        "tokenizer.ggml.bos_token_id": u32(259),
        "tokenizer.ggml.eos_token_id": u32(260),
        "tokenizer.ggml.add_bos_token": mx.array(False),
        "tokenizer.chat_template": "{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
        "{{ m['content'] }}<|im_end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}",
    }
    meta.update(meta_overrides)
    mx.save_gguf(str(path), tensors, {k: v for k, v in meta.items() if v is not None})
    return path


@pytest.fixture(scope="module", params=[True, False], ids=["tied", "untied"])
def original(request, tmp_path_factory) -> tuple[Path, Path, dict]:
    tmp = tmp_path_factory.mktemp("gguf")
    config = {**CONFIG, "tie_word_embeddings": request.param}
    folder = write_tiny_model(tmp / "hf", config, tokenizer=False)
    weights = mx.load(str(folder / "model.safetensors"))
    return folder, write_gguf(tmp / "tiny.gguf", config, weights), weights


def test_round_trip_equals_the_original(original, tmp_path: Path) -> None:
    folder, gguf, weights = original
    out = convert_gguf(gguf, tmp_path / "out", "float32")
    converted = mx.load(str(out / "model.safetensors"))
    assert sorted(converted) == sorted(weights)
    for name, w in weights.items():
        assert mx.array_equal(converted[name], w).item(), name
    config = json.loads((out / "config.json").read_text())
    assert config["tie_word_embeddings"] is ("lm_head.weight" not in weights)
    assert config["rms_norm_eps"] == 1e-5  # float32 in the file, the checkpoint's value back
    assert config["eos_token_id"] == 260

    from mlx_lm.generate import generate_step
    from mlx_lm.utils import load, load_model

    prompt = mx.array([(i * 13 + 5) % 256 for i in range(12)])

    def greedy(model) -> list[int]:
        return [int(t) for t, _ in generate_step(prompt, model, max_tokens=8)]

    model, tokenizer = load(str(out))  # mlx-lm's own load: weights and tokenizer
    assert greedy(model) == greedy(load_model(folder)[0])
    messages = [{"role": "user", "content": "hello"}]
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    assert ids[0] == 259
    text = tokenizer.decode(ids)
    assert text == "<|im_start|>user\nhello<|im_end|>\n<|im_start|>assistant\n"
    assert tokenizer.eos_token_ids == {260}


def test_keep_preserves_float16_and_dtype_casts(original, tmp_path: Path) -> None:
    _, gguf, weights = original
    halves = convert_gguf(gguf, tmp_path / "f16", "float16")
    assert {a.dtype for a in mx.load(str(halves / "model.safetensors")).values()} == {mx.float16}
    kept = convert_gguf(gguf, tmp_path / "keep", "keep")
    assert {a.dtype for a in mx.load(str(kept / "model.safetensors")).values()} == {mx.float32}
    assert "quantization" not in json.loads((kept / "config.json").read_text())


def test_tokenizer_splits_digits_and_keeps_bytes(original, tmp_path: Path) -> None:
    from tokenizers import Tokenizer

    out = convert_gguf(original[1], tmp_path / "out", "float32")
    tok = Tokenizer.from_file(str(out / "tokenizer.json"))
    text = "hello 2025 <|im_end|> é"
    enc = tok.encode(text)
    assert tok.decode(enc.ids, skip_special_tokens=False) == text
    assert 260 in enc.ids  # a control token is matched whole
    assert len(tok.encode("hell").ids) == 1  # the merges apply: "he ll"
    assert tok.encode("2025").ids == [ord(c) for c in "2025"]  # digits one by one


def _cli(*argv: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "dctms.cli.main", "convert-gguf", *argv],
        capture_output=True, text=True,
    )


@pytest.mark.parametrize(
    ("overrides", "tensors", "needle"),
    [
        ({"general.architecture": "gpt2"}, None, "architecture gpt2 is not supported"),
        ({}, {"token_embd.weight": mx.zeros((261, 64), dtype=mx.int32)},
         "tensor type I32 (e.g. token_embd.weight) is not supported"),
        ({"tokenizer.ggml.model": "llama"}, None, "tokenizer model llama is not supported"),
        ({"tokenizer.ggml.pre": "qwen2"}, None, "pre-tokenizer qwen2 is not supported"),
        ({"llama.rope.scaling.type": "yarn"}, None, "RoPE scaling"),
    ],
    ids=["architecture", "tensor-type", "tokenizer", "pre-tokenizer", "rope-scaling"],
)
def test_refusals_are_one_line(original, tmp_path: Path, overrides, tensors, needle) -> None:
    _, _, weights = original
    config = {**CONFIG, "tie_word_embeddings": "lm_head.weight" not in weights}
    path = write_gguf(tmp_path / "x.gguf", config, weights, **overrides)
    if tensors is not None:
        mx.save_gguf(str(path), tensors, {"general.architecture": "llama"})
    proc = _cli(str(path), str(tmp_path / "out"))
    assert proc.returncode == 2, proc.stderr
    assert len(proc.stderr.splitlines()) == 1, proc.stderr
    assert needle in proc.stderr
    assert not (tmp_path / "out").exists()
    assert [p.name for p in tmp_path.iterdir()] == ["x.gguf"]  # no temporary folder left


def test_bad_files_and_existing_output(original, tmp_path: Path) -> None:
    (tmp_path / "not.gguf").write_bytes(b"GGML" + b"\0" * 40)
    assert "not a GGUF file" in _cli(str(tmp_path / "not.gguf"), str(tmp_path / "o")).stderr
    (tmp_path / "short.gguf").write_bytes(b"GGUF\x03\0\0\0")
    assert "header ends early" in _cli(str(tmp_path / "short.gguf"), str(tmp_path / "o")).stderr
    taken = tmp_path / "taken"
    taken.mkdir()
    (taken / "keep.txt").write_text("mine")
    proc = _cli(str(original[1]), str(taken))
    assert proc.returncode == 2 and "already exists" in proc.stderr
    assert (taken / "keep.txt").read_text() == "mine"
    with pytest.raises(DctmsError, match="--dtype must be one of"):
        convert_gguf(original[1], tmp_path / "o", "int8")


# ------------------------------------------------------------------------------------ header checks


def patch_value(path: Path, key: str, fmt: str, value) -> None:
    """Overwrite the scalar value of metadata ``key`` in place (same width): how a hand-edited or
    corrupt file looks, including values MLX's own writer would not write (alignment 0)."""
    data = bytearray(path.read_bytes())
    name = key.encode()
    at = data.index(struct.pack("<Q", len(name)) + name) + 8 + len(name) + 4
    data[at : at + struct.calcsize(fmt)] = struct.pack(fmt, value)
    path.write_bytes(bytes(data))


def _weights_with(weights: dict, **changed) -> dict:
    return {**weights, **{k.replace("__", "."): v for k, v in changed.items()}}


u32 = lambda v: mx.array(v, dtype=mx.uint32)  # noqa: E731
i32 = lambda v: mx.array(v, dtype=mx.int32)  # noqa: E731
NORM = "model.layers.0.input_layernorm.weight"

# (metadata overrides, weight overrides, (key, fmt, value) patched in place, expected words)
BAD_HEADERS = {
    "alignment 0 (was SIGFPE)": ({"general.alignment": u32(32)}, {}, ("general.alignment", "<I", 0),
                                 "general.alignment = 0 is not a power of two"),
    "alignment 48": ({"general.alignment": u32(32)}, {}, ("general.alignment", "<I", 48),
                     "general.alignment = 48 is not a power of two"),
    "alignment not uint32": ({"general.alignment": mx.array(32, dtype=mx.uint64)}, {}, None,
                             "general.alignment is a uint64, not a uint32"),
    "head_count 0": ({"llama.attention.head_count": u32(0)}, {}, None,
                     "llama.attention.head_count = 0 is not positive"),
    "head_count_kv 0": ({"llama.attention.head_count_kv": u32(0)}, {}, None,
                        "llama.attention.head_count_kv = 0 is not positive"),
    "head_count -4 (hung)": ({"llama.attention.head_count": i32(-4)}, {}, None,
                             "llama.attention.head_count = -4 is not positive"),
    "head_count_kv not dividing head_count": ({"llama.attention.head_count_kv": u32(3)}, {}, None,
                                              "head_count_kv = 3 does not divide"),
    "head_count_kv not matching the rows": (
        {"llama.attention.head_count": u32(8)}, {}, None,
        "tensor blk.0.attn_k.weight has shape [32, 64], expected [16, 64] "
        "(llama.attention.head_count_kv = 2 x head dimension 8)"),
    "head_count not dividing embedding_length": ({"llama.attention.head_count": u32(6)}, {}, None,
                                                 "head_count = 6 does not divide "
                                                 "llama.embedding_length = 64"),
    "block_count 10^7 (MemoryError)": ({"llama.block_count": u32(10**7)}, {}, None,
                                       "llama.block_count = 10000000, but the file lacks "
                                       "blk.2.attn_norm.weight"),
    "block_count -1": ({"llama.block_count": i32(-1)}, {}, None,
                       "llama.block_count = -1 is not positive"),
    "block_count below the layers": ({"llama.block_count": u32(1)}, {}, None,
                                     "tensor blk.1.* is layer 1, but llama.block_count = 1"),
    "embedding_length 0": ({"llama.embedding_length": u32(0)}, {}, None,
                           "llama.embedding_length = 0 is not positive"),
    "embedding_length not the tensors'": ({"llama.embedding_length": u32(32)}, {}, None,
                                          "expected [261, 32] (llama.embedding_length = 32)"),
    "feed_forward_length 0": ({"llama.feed_forward_length": u32(0)}, {}, None,
                              "llama.feed_forward_length = 0 is not positive"),
    "rms_epsilon NaN": ({"llama.attention.layer_norm_rms_epsilon": mx.array(float("nan"))}, {},
                        None, "layer_norm_rms_epsilon = nan is not a finite positive number"),
    "rms_epsilon -1e-5": ({"llama.attention.layer_norm_rms_epsilon": mx.array(-1e-5)}, {}, None,
                          "is not a finite positive number"),
    "rms_epsilon inf": ({"llama.attention.layer_norm_rms_epsilon": mx.array(float("inf"))}, {},
                        None, "layer_norm_rms_epsilon = inf is not a finite positive number"),
    "rope base 0": ({"llama.rope.freq_base": mx.array(0.0)}, {}, None,
                    "llama.rope.freq_base = 0.0 is not a finite positive number"),
    "context_length -5": ({"llama.context_length": i32(-5)}, {}, None,
                          "llama.context_length = -5 is not positive"),
    "vocab_size 2^62": ({"llama.vocab_size": mx.array(2**62, dtype=mx.uint64)}, {}, None,
                        "llama.vocab_size = 4611686018427387904, but token_embd.weight has 261 rows"),
    "a count as text": ({"llama.attention.head_count": "four"}, {}, None,
                        "llama.attention.head_count is a string ('four'), not an integer"),
    "eos outside the vocabulary": ({"tokenizer.ggml.eos_token_id": u32(999)}, {}, None,
                                   "tokenizer.ggml.eos_token_id = 999 is above 260"),
    "tokens fewer than the rows": (
        {"tokenizer.ggml.tokens": byte_vocab()[:260],
         "tokenizer.ggml.token_type": mx.array([1] * 259 + [3], dtype=mx.int32)}, {}, None,
        "tokenizer.ggml.tokens holds 260 tokens, but token_embd.weight has 261 rows"),
    "norm weight of 0 elements": ({}, {NORM: mx.zeros((0,))}, None,
                                  "tensor blk.0.attn_norm.weight has a dimension of 0"),
    "norm weight a scalar": ({}, {NORM: mx.array(1.0)}, None,
                             "tensor blk.0.attn_norm.weight has 0 dimensions (1 to 4)"),
    "norm weight of the wrong length": ({}, {NORM: mx.ones((32,))}, None,
                                        "tensor blk.0.attn_norm.weight has shape [32], "
                                        "expected [64] (llama.embedding_length = 64)"),
    "a layer tensor missing": ({}, {"model.layers.1.mlp.up_proj.weight": None}, None,
                               "lacks blk.1.ffn_up.weight (1 layer tensors missing)"),
}  # fmt: skip


def _bad_gguf(tmp_path: Path, weights: dict, case: str) -> Path:
    meta, changed, patch, _ = BAD_HEADERS[case]
    config = {**CONFIG, "tie_word_embeddings": "lm_head.weight" not in weights}
    weights = {k: v for k, v in {**weights, **changed}.items() if v is not None}
    path = write_gguf(tmp_path / "x.gguf", config, weights, **meta)
    if patch is not None:
        patch_value(path, *patch)
    return path


@pytest.fixture(scope="module")
def tied(tmp_path_factory) -> dict:
    """The tied model's weights alone (the header checks do not depend on tying)."""
    config = {**CONFIG, "tie_word_embeddings": True}
    folder = write_tiny_model(tmp_path_factory.mktemp("tied") / "hf", config, tokenizer=False)
    return mx.load(str(folder / "model.safetensors"))


@pytest.mark.parametrize("case", sorted(BAD_HEADERS))
def test_header_refusals_name_the_value_and_write_nothing(tied, tmp_path, capsys, case):
    """Every class of issue 35's GGUF reproductions: one line naming the key or tensor and the
    value, exit 2, no output folder (or temporary one) left, an existing empty one untouched."""
    from dctms.cli.main import main

    path = _bad_gguf(tmp_path, tied, case)
    out = tmp_path / "out"
    assert main(["convert-gguf", str(path), str(out)]) == 2
    err = capsys.readouterr().err
    assert len(err.splitlines()) == 1, err
    assert BAD_HEADERS[case][3] in err, err
    assert [p.name for p in tmp_path.iterdir()] == ["x.gguf"]
    out.mkdir()
    assert main(["convert-gguf", str(path), str(out)]) == 2
    assert not any(out.iterdir())
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out", "x.gguf"]


def test_alignment_zero_is_refused_without_a_signal(tied, tmp_path) -> None:
    """MLX's reader divides by general.alignment: 0 was a SIGFPE of the whole process."""
    path = _bad_gguf(tmp_path, tied, "alignment 0 (was SIGFPE)")
    proc = _cli(str(path), str(tmp_path / "out"))
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.strip().endswith("general.alignment = 0 is not a power of two")


def test_truncated_and_lying_files_are_refused_before_mlx_reads_them(original, tmp_path) -> None:
    """MLX's reader trusts every length and offset: a cut file, a string or tensor count that
    runs past the end, or a tensor offset off the alignment would be read out of bounds."""
    from dctms.convert.gguf_header import read_header

    data = original[1].read_bytes()
    head = read_header(original[1])
    cuts = {
        len(data) - 1: "past the end of the file",  # the last tensor's data
        head.data_start - 1: "past the end of the file",
        1000: "header ends early",
    }
    for cut, words in cuts.items():
        bad = tmp_path / f"cut{cut}.gguf"
        bad.write_bytes(data[:cut])
        with pytest.raises(DctmsError, match=words):
            convert_gguf(bad, tmp_path / "o")
    lying = {
        "tensor count": (8, "<Q", 10**6, "tensor count 1000000 does not fit in the file"),
        "metadata count": (16, "<Q", 2**40, "metadata count 1099511627776 does not fit"),
        "first key length": (24, "<Q", 2**20, "a metadata key of 1048576 bytes"),
    }
    for name, (at, fmt, value, words) in lying.items():
        bad = tmp_path / f"{name}.gguf"
        bad.write_bytes(data[:at] + struct.pack(fmt, value) + data[at + struct.calcsize(fmt) :])
        with pytest.raises(DctmsError, match=words):
            convert_gguf(bad, tmp_path / "o")
    assert not (tmp_path / "o").exists()


def test_special_tokens_use_llama_cpp_key_names(tied, tmp_path) -> None:
    """llama.cpp writes tokenizer.ggml.unknown_token_id (not unk_...): it was never read."""
    config = {**CONFIG, "tie_word_embeddings": True}
    path = write_gguf(
        tmp_path / "x.gguf", config, tied,
        **{"tokenizer.ggml.unknown_token_id": u32(0), "tokenizer.ggml.padding_token_id": u32(260)},
    )  # fmt: skip
    out = convert_gguf(path, tmp_path / "out", "float32")
    tokenizer_config = json.loads((out / "tokenizer_config.json").read_text())
    assert tokenizer_config["unk_token"] == byte_vocab()[0]
    assert tokenizer_config["pad_token"] == "<|im_end|>"


@pytest.fixture(scope="module")
def field_by_field(tmp_path_factory):
    """The fuzzer's starting GGUF (written field by field, ``gguf_bytes``): values of any type."""
    from fuzz_inputs import LLAMA, base_gguf

    folder = write_tiny_model(tmp_path_factory.mktemp("fbf") / "llama", LLAMA, tokenizer=False)
    return base_gguf(folder)


def test_float64_metadata_is_refused_before_mlx_misreads_it(field_by_field, tmp_path) -> None:
    """MLX's reader steps over 4 bytes of a float64 value, not 8, and misreads the rest of the
    header: a SIGSEGV the input fuzzer found (general.name = -0.0 as a float64)."""
    import copy

    import gguf_bytes as gb

    g = copy.deepcopy(field_by_field)
    g.metadata.append(("general.name", gb.F64, -0.0))
    (tmp_path / "x.gguf").write_bytes(g.encode())
    proc = _cli(str(tmp_path / "x.gguf"), str(tmp_path / "out"))
    assert proc.returncode == 2, proc.stderr
    assert "general.name is a float64 (-0.0); MLX's GGUF reader misreads float64" in proc.stderr
    assert [p.name for p in tmp_path.iterdir()] == ["x.gguf"]


def test_tokenizer_keys_of_the_wrong_type_are_refused(field_by_field, tmp_path) -> None:
    """tokenizer.ggml.merges as an int8 was a TypeError (exit 70) in the tokenizer builder."""
    import copy

    import gguf_bytes as gb

    g = copy.deepcopy(field_by_field)
    g.metadata = [m for m in g.metadata if m[0] != "tokenizer.ggml.merges"]
    g.metadata.append(("tokenizer.ggml.merges", gb.I8, 65))
    (tmp_path / "x.gguf").write_bytes(g.encode())
    with pytest.raises(DctmsError, match="merges is of type int8 \\(65\\), expected array of string"):
        convert_gguf(tmp_path / "x.gguf", tmp_path / "out")
    assert not (tmp_path / "out").exists()
