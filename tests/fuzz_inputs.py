"""Issue 35's fuzzers for the importers and inputs: GGUF files (``convert-gguf``), pack CSVs
(``pack``) and image files (``run --image``). ``cases(seed, count, fixtures)`` yields deterministic
``fuzz_cases.Case`` records; ``python fuzz_inputs.py FIXTURES SEED START COUNT WORK`` runs a range
of them in this process, as ``fuzz_worker.py`` does (``start ID`` before each case, one JSON line per
problem, ``done N``).

Families (about the share of a run): ``gguf`` (38 %: a small valid llama GGUF written field by field
(``gguf_bytes``), then a metadata value retyped or set to an extreme, a key removed, repeated or
added, a tensor's dimensions, type, name or data changed, a count, length, dimension or offset field
overwritten in place, or the bytes cut, flipped or spliced), ``pack`` (43 %: a random problem's CSV
with a cell, row, header or the bytes damaged, problems of thousands of buffers live together,
sizes adding up past 2^62, odd options), ``image`` (19 %: PNG/JPEG files of many modes with their
header sizes, chunks, markers or bytes damaged, and other formats), run through the image input
layer (``read_images`` and ``prepare`` with the plan and processor loaded once: a ``run`` call costs
0.1-0.6 s, most of it reading the plan), and ``image_run`` (0.25 %: the same files through
``dctms run``, generation included). A problem: a traceback or an exception other than a one-line
``DctmsError``, an exit status a command may not end with, a refusal of more than one line, a file
created or changed by a refusal, an incomplete output, a case running more than ``SLOW`` seconds.
"""

from __future__ import annotations

import base64
import copy
import io
import json
import math
import random
import struct
import sys
import time
import zlib
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

import gguf_bytes as gb  # noqa: E402
from fuzz_cases import Case  # noqa: E402
from image_files import chunk, png  # noqa: E402

SLOW = 20.0  # seconds: a case running longer is a problem (the budgets here are far smaller)
VLM_FAMILIES = ("gemma3", "qwen2_vl")
MODEL_FILES = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json")
# The tiny llama the GGUF family starts from (hidden 32, one layer: converts in tens of ms).
LLAMA = {
    "model_type": "llama",
    "hidden_size": 32,
    "num_hidden_layers": 1,
    "intermediate_size": 64,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 261,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "max_position_embeddings": 256,
    "tie_word_embeddings": True,
    "torch_dtype": "float32",
}


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def cases(seed: int, count: int, fixtures: Path) -> Iterator[Case]:
    rng = random.Random(seed)
    base = base_gguf(fixtures / "llama")
    makers = [(_gguf, 152), (_pack, 172), (_image, 75), (_image_run, 1)]
    families = [m for m, w in makers for _ in range(w)]
    for i in range(count):
        yield families[rng.randrange(len(families))](i, rng, base)


# ------------------------------------------------------------------------------------ GGUF


def base_gguf(folder: Path) -> gb.Gguf:
    """The tiny llama of ``folder`` (an mlx-lm folder) as a GGUF description."""
    import mlx.core as mx
    import numpy as np

    from dctms.convert.gguf_check import GLOBAL_TENSORS, LAYER_TENSORS
    from dctms.toolkit.tiny_model import _bytes_to_unicode

    names = {v: k for k, v in GLOBAL_TENSORS.items()}
    layer_names = {v: k for k, v in LAYER_TENSORS.items()}
    tensors = []
    for name, w in sorted(mx.load(str(folder / "model.safetensors")).items()):
        base = name.removesuffix(".weight")
        if base in names:
            gguf = names[base]
        else:
            _, _, layer, rest = base.split(".", 3)
            gguf = f"blk.{layer}.{layer_names[rest]}"
        array = np.asarray(w.astype(mx.float32))
        tensors.append(gb.Tensor(f"{gguf}.weight", list(reversed(array.shape)), gb.F32_TENSOR,
                                 array.tobytes()))  # fmt: skip
    chars = _bytes_to_unicode()
    vocab = [chars[b] for b in range(256)] + ["he", "ll", "hell", "<|im_start|>", "<|im_end|>"]
    c = LLAMA
    meta = [
        ("general.architecture", gb.STRING, "llama"),
        ("general.alignment", gb.U32, 32),
        ("llama.embedding_length", gb.U32, c["hidden_size"]),
        ("llama.block_count", gb.U32, c["num_hidden_layers"]),
        ("llama.feed_forward_length", gb.U32, c["intermediate_size"]),
        ("llama.attention.head_count", gb.U32, c["num_attention_heads"]),
        ("llama.attention.head_count_kv", gb.U32, c["num_key_value_heads"]),
        ("llama.attention.layer_norm_rms_epsilon", gb.F32, c["rms_norm_eps"]),
        ("llama.rope.freq_base", gb.F32, c["rope_theta"]),
        ("llama.context_length", gb.U32, c["max_position_embeddings"]),
        ("llama.vocab_size", gb.U32, len(vocab)),
        ("tokenizer.ggml.model", gb.STRING, "gpt2"),
        ("tokenizer.ggml.pre", gb.STRING, "smollm"),
        ("tokenizer.ggml.tokens", gb.ARRAY, (gb.STRING, vocab)),
        ("tokenizer.ggml.merges", gb.ARRAY, (gb.STRING, ["h e", "l l", "he ll"])),
        ("tokenizer.ggml.token_type", gb.ARRAY, (gb.I32, [1] * 259 + [3, 3])),
        ("tokenizer.ggml.bos_token_id", gb.U32, 259),
        ("tokenizer.ggml.eos_token_id", gb.U32, 260),
        ("tokenizer.ggml.add_bos_token", gb.BOOL, 0),
        ("tokenizer.chat_template", gb.STRING, "{% for m in messages %}{{ m['content'] }}{% endfor %}"),
    ]  # fmt: skip
    return gb.Gguf(meta, tensors)


_BITS = {gb.U8: (0, 255), gb.I8: (-128, 127), gb.U16: (0, 2**16 - 1), gb.I16: (-(2**15), 2**15 - 1),
         gb.U32: (0, 2**32 - 1), gb.I32: (-(2**31), 2**31 - 1), gb.U64: (0, 2**64 - 1),
         gb.I64: (-(2**63), 2**63 - 1)}  # fmt: skip
_ODD_INTS = [0, 1, 2, 3, 4, 5, 7, 8, 31, 32, 33, 48, 63, 64, 65, 128, 255, 256, 260, 261, 262,
             10**7, 2**31 - 1, 2**31, 2**32 - 1, 2**53, 2**62, 2**63, -1, -4, -(2**31)]  # fmt: skip
_ODD_FLOATS = [math.nan, math.inf, -math.inf, 0.0, -0.0, -1e-5, 1e-45, 1e-30, 3e38, 1.0, 1e-5]
_ODD_TEXT = ["", "x", "llama", "gpt2", "qwen2", "none", "yarn", "default", "\u00e9", "a" * 300]


def _odd_value(rng: random.Random) -> tuple[int, object]:
    kind = rng.choice(list(_BITS) * 3 + [gb.F32, gb.F64] * 3 + [gb.BOOL, gb.STRING, gb.ARRAY])
    if kind in _BITS:
        low, high = _BITS[kind]
        fits = [v for v in _ODD_INTS if low <= v <= high] + [low, high]
        return kind, rng.choice(fits)
    if kind in (gb.F32, gb.F64):
        return kind, rng.choice(_ODD_FLOATS)
    if kind == gb.BOOL:
        return kind, rng.choice([0, 1, 2, 255])
    if kind == gb.STRING:
        return kind, rng.choice(_ODD_TEXT + [b"\xff\xfe"])
    item = rng.choice([gb.U32, gb.I32, gb.STRING, gb.F32, gb.BOOL])
    values = {gb.STRING: ["a", "b c"], gb.F32: [1.0, math.nan], gb.BOOL: [0, 1]}.get(item, [0, 1, 2])
    return kind, (item, values[: rng.randrange(len(values) + 1)])


def _gguf(i: int, rng: random.Random, base: gb.Gguf) -> Case:
    g = copy.deepcopy(base)
    how = rng.choice(["valid"] + ["value"] * 8 + ["tensor"] * 6 + ["field"] * 6 + ["bytes"] * 5)
    data = None
    if how == "value":
        _mutate_metadata(rng, g)
    elif how == "tensor":
        _mutate_tensor(rng, g)
    elif how == "field":
        data = bytearray(g.encode())
        for _ in range(rng.choice([1, 1, 2])):
            at, fmt, _what = rng.choice(g.fields)
            width = struct.calcsize(fmt)
            (old,) = struct.unpack(fmt, data[at : at + width])
            top = 2 ** (8 * width) - 1
            value = rng.choice([0, 1, 2, top, top - 1, top // 2, old + 1, max(old - 1, 0), old * 2,
                                old + 32, 2**31, 2**32, 10**6]) & top  # fmt: skip
            data[at : at + width] = value.to_bytes(width, "little")
    elif how == "bytes":
        data = bytearray(g.encode())
        header = max(at for at, _, _ in g.fields) + 8
        kind = rng.choice(["cut", "cut", "flip", "splice", "junk", "empty", "magic"])
        if kind == "cut":
            data = data[: rng.randrange(header if rng.random() < 0.8 else len(data))]
        elif kind == "flip":
            for _ in range(rng.randint(1, 4)):
                data[rng.randrange(header)] = rng.randrange(256)
        elif kind == "splice":
            at = rng.randrange(header)
            data[at:at] = rng.choice([b"\x00", b"\xff" * 8, b"GGUF", bytes(13)])
        elif kind == "junk":
            data += bytes(rng.randrange(256) for _ in range(64))
        elif kind == "empty":
            data = bytearray(rng.choice([b"", b"GGUF", b"GGUF\x03\x00\x00\x00", b"GGML" + bytes(40)]))
        else:
            data[0:4] = rng.choice([b"FUGG", b"GGJT", b"\x00GUF"])
    encoded = bytes(data) if data is not None else g.encode()
    argv = ["convert-gguf", "{d}/m.gguf", "{d}/out", "-q", "--dtype",
            rng.choice(["keep", "keep", "float32", "float16", "bfloat16"])]  # fmt: skip
    outputs = ["out"] + [f"out/{name}" for name in MODEL_FILES]
    return Case(i, f"gguf_{how}", "convert-gguf", argv, {"m.gguf": _b64(encoded)}, outputs)


def _mutate_metadata(rng: random.Random, g: gb.Gguf) -> None:
    k = rng.randrange(len(g.metadata))
    key, kind, value = g.metadata[k]
    what = rng.random()
    if what < 0.55:
        new_kind, new_value = _odd_value(rng)
        if rng.random() < 0.5 and kind in _BITS:  # the same type, an odd value of it
            low, high = _BITS[kind]
            new_kind, new_value = kind, rng.choice([v for v in _ODD_INTS if low <= v <= high])
        g.metadata[k] = (key, new_kind, new_value)
    elif what < 0.7:
        del g.metadata[k]
    elif what < 0.8:
        g.metadata.insert(rng.randrange(len(g.metadata) + 1), (key, kind, value))
    elif what < 0.9:
        extra = rng.choice(["llama.attention.key_length", "llama.attention.value_length",
                            "llama.rope.dimension_count", "llama.rope.scaling.type",
                            "tokenizer.ggml.unknown_token_id", "tokenizer.ggml.padding_token_id",
                            "general.name", "x"])  # fmt: skip
        g.metadata.append((extra, *_odd_value(rng)))
    else:  # the token list, shorter or longer, with odd tokens
        tokens = next(v for kk, _, v in g.metadata if kk == "tokenizer.ggml.tokens")[1]
        tokens[:] = tokens[: rng.choice([0, 1, 100, 260])] + rng.choice([[], ["", "", "\u00e9"]])


def _mutate_tensor(rng: random.Random, g: gb.Gguf) -> None:
    k = rng.randrange(len(g.tensors))
    t = g.tensors[k]
    what = rng.random()
    if what < 0.35:
        dims = list(t.dims)
        choice = rng.random()
        if choice < 0.5 and dims:
            dims[rng.randrange(len(dims))] = rng.choice([0, 1, 2, 7, 16, 31, 32, 33, 64, 128,
                                                         2**31, 2**32 + 1, 2**63])  # fmt: skip
        elif choice < 0.75:
            dims = dims[: rng.randrange(len(dims) + 1)]
        else:
            dims = dims + [1] * rng.randint(1, 4)
        t.dims = dims
        count = 1
        for d in dims:
            count *= d
        if rng.random() < 0.6 and count * 4 <= 1 << 20:  # data to match the new shape
            t.data = bytes(count * 4)
    elif what < 0.55:
        t.type_id = rng.choice([1, 2, 3, 8, 12, 14, 24, 26, 30, 31, 99, 2**32 - 1])
        if t.type_id == 1 and rng.random() < 0.7:
            t.data = t.data[: len(t.data) // 2]  # F16 data of the shape
    elif what < 0.75:
        t.name = rng.choice(["", "a" * 65, "blk.99.attn_q.weight", "blk.01.attn_q.weight",
                             "output.bias", "rope_freqs.weight", "blk.0.attn_q", "token_embd.scales",
                             g.tensors[rng.randrange(len(g.tensors))].name, "blk.0.\u00e9.weight",
                             "blk.-1.attn_q.weight"])  # fmt: skip
    elif what < 0.85:
        del g.tensors[k]
    elif what < 0.95:
        t.data = t.data[: rng.randrange(len(t.data) + 1)]
    else:
        g.alignment = rng.choice([1, 8, 64, 4096])
        g.metadata = [m for m in g.metadata if m[0] != "general.alignment"]
        g.metadata.append(("general.alignment", gb.U32, g.alignment))


# ------------------------------------------------------------------------------------ pack

_PACK_ODD = ["0", "-1", "1", "+5", " 7 ", "-0", "0x10", "1_000", "1e3", "1.0", "nan", "inf", "",
             "9007199254740992", "9007199254740993", "4611686018427387904", "9223372036854775808",
             "9" * 41, "-" + "9" * 30, "\u0661\u0662", "\uff15", '"', "a,b", "\x00"]  # fmt: skip


def _pack(i: int, rng: random.Random, base) -> Case:
    n = rng.randint(1, 60)
    aligned = rng.random() < 0.5
    header = ["id", "start", "end", "size"] + (["alignment"] if aligned else [])
    rows = []
    for k in range(n):
        start = rng.randrange(100)
        row = [f"b{k}", str(start), str(start + rng.randint(1, 40)),
               str(rng.choice([0, 1, 64, 100, 4096, 1 << 20]))]  # fmt: skip
        if aligned:
            row.append(str(rng.choice([1, 2, 64, 4096])))
        rows.append(row)
    how = rng.choice(["valid"] * 6 + ["cell"] * 14 + ["rows"] * 4 + ["header"] * 4
                     + ["bytes"] * 4 + ["scale"] + ["options"] * 4)  # fmt: skip
    if how == "cell":
        for _ in range(rng.choice([1, 1, 2])):
            rows[rng.randrange(n)][rng.randrange(len(header))] = rng.choice(_PACK_ODD)
    elif how == "rows":
        what = rng.choice(["dup_row", "dup_id", "short", "long", "blank", "no_rows"])
        if what == "dup_row":
            rows.append(list(rows[0]))
        elif what == "dup_id":
            rows[-1][0] = rows[0][0]
        elif what == "short":
            rows[rng.randrange(n)].pop()
        elif what == "long":
            rows[rng.randrange(n)].append("5")
        elif what == "blank":
            rows.insert(rng.randrange(n + 1), [])
        else:
            rows = []
    elif how == "header":
        what = rng.choice(["unknown", "dup", "missing", "order", "case", "spaces"])
        if what == "unknown":
            header[rng.randrange(len(header))] = "colour"
        elif what == "dup":
            header[1] = "id"
        elif what == "missing":
            del header[rng.randrange(len(header))]
        elif what == "order":
            perm = list(range(len(header)))
            rng.shuffle(perm)
            header = [header[j] for j in perm]
            rows = [[r[j] for j in perm] for r in rows]
        elif what == "case":
            header = [h.upper() for h in header]
        else:
            header = [f" {h} " for h in header]
    elif how == "scale":
        what = rng.choice(["identical", "clique", "absurd", "window"])
        m = rng.choice([300, 600, 1200, 2000])
        if what == "identical":
            rows = [[f"b{k}", "0", "10", "4096"] + (["64"] if aligned else []) for k in range(m)]
        elif what == "clique":
            rows = [[f"b{k}", str(k), str(10**6 + k), str(rng.randrange(1, 5000))]
                    + (["64"] if aligned else []) for k in range(m)]  # fmt: skip
        elif what == "absurd":
            rows = [[f"b{k}", "0", "1", str(2**53)] + (["1"] if aligned else [])
                    for k in range(rng.choice([511, 512, 513, 1025]))]  # fmt: skip
        else:
            rows = [[f"b{k}", str(k), str(k + 300), str(rng.randrange(1, 5000))]
                    + (["64"] if aligned else []) for k in range(m)]  # fmt: skip
    text = "\n".join(",".join(r) for r in [header] + rows) + "\n"
    data = text.encode("utf-8", "surrogatepass")
    if how == "bytes":
        what = rng.choice(["cut", "nul", "latin1", "crlf", "cr", "bom", "long_line", "empty"])
        if what == "cut":
            data = data[: rng.randrange(len(data) + 1)]
        elif what == "nul":
            at = rng.randrange(len(data))
            data = data[:at] + b"\x00" + data[at:]
        elif what == "latin1":
            data = data + b"b99,0,1,\xe9\n"
        elif what == "crlf":
            data = data.replace(b"\n", b"\r\n")
        elif what == "cr":
            data = data.replace(b"\n", b"\r")
        elif what == "bom":
            data = b"\xef\xbb\xbf" + data
        elif what == "long_line":
            data = data + b"x" * 200_000 + b",0,1,8\n"
        else:
            data = b""
    seconds = rng.choice(["0", "0", "0.01", "0.05"])
    argv = ["pack", "{d}/p.csv", "--seconds", seconds]
    outputs: list[str] = []
    if how == "options":
        option = rng.choice(["seconds", "alignment", "output"])
        if option == "seconds":
            argv[3] = rng.choice(["nan", "inf", "-inf", "-0", "1e-300", "3601", "-1", "x", "1e999"])
        elif option == "alignment":
            argv += ["--alignment", rng.choice(["0", "-1", "3", "1073741824", "2147483648", "x"])]
        else:
            argv += ["-o", rng.choice(["{d}/p.csv", "{d}", "{d}/none/o.csv", "-", "/dev/full"])]
    if rng.random() < 0.3:
        argv.append("--json")
    if rng.random() < 0.4 and "-o" not in argv:
        argv += ["-o", "{d}/o.csv"]
        outputs.append("o.csv")
    return Case(i, f"pack_{how}", "pack", argv, {"p.csv": _b64(data)}, outputs)


# ------------------------------------------------------------------------------------ images


def _valid_image(rng: random.Random) -> tuple[bytes, str]:
    import numpy as np
    from PIL import Image

    h, w = rng.choice([(1, 1), (20, 30), (32, 32), (40, 50), (3, 200), (200, 2), (7, 7), (90, 60)])
    mode = rng.choice(["RGB", "RGB", "L", "RGBA", "P", "LA", "I;16", "1"])
    fmt = "JPEG" if mode in ("RGB", "L") and rng.random() < 0.4 else "PNG"
    pixels = np.random.default_rng(rng.randrange(1000)).integers(0, 255, (h, w, 3), np.uint8)
    img = Image.fromarray(pixels).convert(mode if mode != "I;16" else "I")
    if mode == "I;16":
        img = img.convert("I;16")
    out = io.BytesIO()
    options = {"interlace": 1} if fmt == "PNG" and rng.random() < 0.2 else {}
    if fmt == "JPEG" and rng.random() < 0.3:
        options = {"progressive": True}
    img.save(out, fmt, **options)
    return out.getvalue(), fmt


def _image_file(rng: random.Random) -> tuple[str, bytes]:
    how = rng.choice(["valid"] * 4 + ["header"] * 5 + ["cut"] * 3 + ["flip"] * 3 + ["chunks"] * 2
                     + ["jpeg"] * 2 + ["other"])  # fmt: skip
    data, fmt = _valid_image(rng)
    if how == "header":
        sizes = [0, 1, 2, 199, 200, 201, 300, 1000, 9000, 10_000, 30_000, 2**16, 2**31 - 1,
                 2**32 - 1]  # fmt: skip
        depth, color = rng.choice([(8, 2), (8, 2), (8, 0), (8, 6), (16, 2), (1, 0), (8, 3),
                                   (8, 7), (3, 2), (0, 0)])  # fmt: skip
        width, height = rng.choice(sizes), rng.choice(sizes)
        if 4_000_000 < width * height <= 89_478_485:  # decodable but slow: one over PIL's bound
            width, height = 10_000, 9_000
        data = png(width, height, color_type=color, bit_depth=depth)
    elif how == "cut":
        data = data[: rng.randrange(len(data))]
    elif how == "flip":
        data = bytearray(data)
        for _ in range(rng.randint(1, 6)):
            data[rng.randrange(len(data))] = rng.randrange(256)
        data = bytes(data)
    elif how == "chunks" and fmt == "PNG":
        head, rest = data[:33], data[33:]
        what = rng.choice(["crc", "no_iend", "length", "unknown_critical", "ztxt_bomb", "iccp",
                           "two_ihdr", "idat_first"])  # fmt: skip
        if what == "crc":
            data = head[:29] + b"\x00\x00\x00\x00" + rest
        elif what == "no_iend":
            data = data[:-12]
        elif what == "length":
            data = head + b"\x7f\xff\xff\xff" + rest[4:]
        elif what == "unknown_critical":
            data = head + chunk(b"abCD", b"x" * 10) + rest
        elif what == "ztxt_bomb":
            data = head + chunk(b"zTXt", b"k\x00\x00" + zlib.compress(bytes(20_000_000))) + rest
        elif what == "iccp":
            data = head + chunk(b"iCCP", b"p\x00\x00" + zlib.compress(b"junk" * 100)) + rest
        elif what == "two_ihdr":
            data = head + data[8:33] + rest
        else:
            data = data[:8] + rest[:-12] + data[8:33] + data[-12:]
    elif how == "jpeg" and fmt == "JPEG":
        at = data.find(b"\xff\xc0")
        if at < 0:
            at = data.find(b"\xff\xc2")
        if at >= 0:
            field_at = at + 5 + rng.choice([0, 2])  # the frame's height or width
            value = rng.choice([0, 1, 65535, 30000])
            data = data[:field_at] + struct.pack(">H", value) + data[field_at + 2 :]
        else:
            data = data[: len(data) // 2]
    elif how == "other":
        from PIL import Image

        kind = rng.choice(["GIF", "BMP", "TIFF", "WEBP", "empty", "text", "magic"])
        if kind in ("GIF", "BMP", "TIFF", "WEBP"):
            out = io.BytesIO()
            Image.new("RGB", (8, 8)).save(out, kind)
            data = out.getvalue()
        else:
            data = {"empty": b"", "text": b"hello\n", "magic": b"\x89PNG\r\n\x1a\n"}[kind]
    return how, data


def _image(i: int, rng: random.Random, base) -> Case:
    how, data = _image_file(rng)
    family = rng.choice(VLM_FAMILIES)
    return Case(i, f"image_{how}", "image", [family], {"i.img": _b64(data)})


def _image_run(i: int, rng: random.Random, base) -> Case:
    how, data = _image_file(rng)
    family = rng.choice(VLM_FAMILIES)
    argv = ["run", f"{{f}}/{family}.plan", "--model", f"{{f}}/{family}", "--prompt", "x",
            "--image", "{d}/i.img", "--max-tokens", "1", "--report", "{d}/r.json"]  # fmt: skip
    return Case(i, f"image_run_{how}", "run", argv, {"i.img": _b64(data)}, ["r.json"])


class ImageInputs:
    """The vision plans, processors and tokenizers, loaded once (per worker)."""

    def __init__(self, fixtures: Path) -> None:
        from dctms.runner.tokenize import Tokenizer
        from dctms.runner.vision_input import image_processor
        from dctms.schema.io import read_plan

        self.loaded = {
            family: (read_plan(fixtures / f"{family}.plan"), fixtures / family,
                     image_processor(fixtures / family), Tokenizer(fixtures / family))
            for family in VLM_FAMILIES
        }  # fmt: skip

    def run(self, case: dict, work: Path) -> tuple[str | None, bool]:
        """(None, or the problem: anything but a result or a one-line ``DctmsError``; whether
        the image was accepted)."""
        from dctms.runner.vision_input import prepare, read_images
        from dctms.schema.errors import DctmsError

        path = work / "i.img"
        path.write_bytes(base64.b64decode(case["files"]["i.img"]))
        plan, folder, processor, tokenizer = self.loaded[case["argv"][0]]
        try:
            images = read_images([str(path)], plan, processor)
            inputs = prepare(plan, folder, tokenizer, "x", images, processor)
        except DctmsError as err:
            text = str(err)
            if "\n" in text or not text:
                return f"refusal is not one line: {text[:300]!r}", False
            return None, False
        except BaseException as exc:  # noqa: BLE001 - that is the finding
            return f"raised {type(exc).__name__}: {str(exc)[:300]}", False
        finally:
            path.unlink()
        if len(inputs.pixels) != 1:
            return f"one image gave {len(inputs.pixels)} pixel arrays", True
        return None, True


# ------------------------------------------------------------------------------------ worker


def complete(path: Path) -> str | None:
    """Why an output of these commands is not complete (a model folder, an offsets file)."""
    if path.is_dir():
        names = {p.name for p in path.iterdir()}
        if names != set(MODEL_FILES):
            return f"converted folder holds {sorted(names)}"
        json.loads((path / "config.json").read_text())
        return None
    if path.suffix == ".csv":
        import numpy as np

        from dctms.toolkit.pack.csv_io import parse_csv
        from dctms.toolkit.pack.problem import is_valid

        ids, problem = parse_csv((path.parent / "p.csv").read_bytes().decode("utf-8-sig"), "p")
        lines = path.read_text().splitlines()
        offsets = [int(line.rsplit(",", 1)[1]) for line in lines[1:]]
        if len(offsets) != len(ids) or not is_valid(problem, np.asarray(offsets, dtype=np.int64)):
            return "written offsets are not a valid packing of the input"
        return None
    return _generic_complete(path)


def main_loop() -> None:
    import functools

    import fuzz_worker

    from dctms.cli import main as cli

    global _generic_complete
    _generic_complete = fuzz_worker.complete
    fuzz_worker.complete = complete  # the judge checks these commands' outputs in full
    fixtures, seed, start, count, work = (
        Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), Path(sys.argv[5])
    )  # fmt: skip
    cli.build_parser = functools.cache(cli.build_parser)
    images = ImageInputs(fixtures)
    work.mkdir(parents=True, exist_ok=True)
    ran, outcomes, codes, seconds = 0, Counter(), [], Counter()

    def main(argv: list[str]) -> int:
        codes.append(cli.main(argv))
        return codes[-1]

    for case in cases(seed, start + count, fixtures):
        if case.id < start:
            continue
        record = json.loads(case.to_json())
        print(f"start {case.id}", flush=True)
        t0 = time.perf_counter()
        codes.clear()
        if case.command == "image":
            problem, accepted = images.run(record, work)
        else:
            problem = fuzz_worker.run_case(record, fixtures, work, main)
            accepted = codes == [0]
        family = case.family.split("_")[0]
        outcomes[f"{family} {'accepted' if accepted else 'refused'}"] += 1
        took = time.perf_counter() - t0
        seconds[case.family] += took
        if problem is None and took > SLOW:
            problem = f"took {took:.1f} s"
        ran += 1
        if problem is not None:
            print(json.dumps({"id": case.id, "family": case.family, "argv": case.argv,
                              "problem": problem}), flush=True)  # fmt: skip
    print(f"outcomes {json.dumps(outcomes)}", flush=True)
    print(f"seconds {json.dumps({k: round(v, 2) for k, v in seconds.most_common()})}", flush=True)
    print(f"done {ran}", flush=True)


_generic_complete = None

if __name__ == "__main__":
    main_loop()
