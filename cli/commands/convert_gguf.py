"""``dctms convert-gguf FILE.gguf OUT [--dtype ...]``: a llama.cpp GGUF file -> an mlx-lm folder."""

from __future__ import annotations

import argparse

from dctms.cli.progress import progress_printer


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "convert-gguf",
        help="convert a llama.cpp GGUF file into an mlx-lm model folder",
        description=(
            "Read FILE.gguf with MLX's own GGUF reader and write OUT: config.json, "
            "model.safetensors (mlx-lm's tensor names, llama.cpp's q/k row permutation undone), "
            "tokenizer.json (a byte-level BPE built from the GGUF vocabulary and merges) and "
            "tokenizer_config.json (special tokens and the chat template). mlx-lm's load reads "
            "the folder; dctms compile and run do too. Architectures: llama. Tensor types: F32, "
            "F16, Q4_0, Q4_1, Q8_0; anything else is refused naming it."
        ),
    )
    p.add_argument("gguf", metavar="FILE.gguf")
    p.add_argument("out", metavar="OUT", help="new model folder (must not exist, or be empty)")
    p.add_argument(
        "--dtype",
        choices=["keep", "float32", "float16", "bfloat16"],
        default="keep",
        help="keep: quantised layers as MLX quantised triplets, the rest as stored (default); "
        "float32/float16/bfloat16: dequantise every tensor to that dtype",
    )
    p.add_argument("-q", "--quiet", action="store_true", help="no progress on stderr")
    p.add_argument(
        "--progress", action="store_true", help="progress on stderr even when it is not a terminal"
    )
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from dctms.convert.gguf import convert_gguf

    progress = progress_printer(args)

    out = convert_gguf(args.gguf, args.out, args.dtype, progress)
    progress(f"wrote {out}")
    return 0
