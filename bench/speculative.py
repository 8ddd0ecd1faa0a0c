"""Speculative decoding, ids and acceptance per K: the dctms speculative runner against the plain
runner and mlx-lm's ``speculative_generate_step``, on tiny random-weight qwen2 targets.

Two drafts per target: the target itself (every draft token must be accepted) and a draft that keeps
the target's first layers (weights copied). For each K the table gives whether the ids equal the
plain runner's and mlx-lm's on every prompt, the acceptance of both speculative systems, and the
plan's provable M_max over MLX's observed peak during the speculative runs (measured before mlx-lm
loads its own copies). Run: .venv/bin/python bench/speculative.py [--ks 1,2,3,4] [--layers 4]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

import mlx.core as mx

from dctms.runner.request import validate_request
from dctms.runner.session import Session
from dctms.runner.speculative import SpeculativeSession
from dctms.schema.model_folder import open_model, open_model_folder
from dctms.toolkit.compiler import CompileOptions
from dctms.toolkit.kinds.speculative import compile_speculative
from dctms.toolkit.tiny_model import DEMO_CONFIG, write_tiny_model

PROMPTS = ([7], [5, 17, 33, 200, 9, 41, 7], [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5] * 3)
N, M, CHUNK = 48, 32, 16


def first_layers(target: Path, folder: Path, layers: int) -> Path:
    config = json.loads((target / "config.json").read_text())
    config["num_hidden_layers"] = layers
    weights = mx.load(str(target / "model.safetensors"))
    kept = {
        k: v
        for k, v in weights.items()
        if not k.startswith("model.layers.") or int(k.split(".")[2]) < layers
    }
    folder.mkdir(parents=True)
    mx.save_safetensors(str(folder / "model.safetensors"), kept, metadata={"format": "mlx"})
    (folder / "config.json").write_text(json.dumps(config) + "\n")
    return folder


def mlx_lm_run(target, draft, prompt: list[int], k: int) -> tuple[list[int], int]:
    from mlx_lm.generate import speculative_generate_step

    ids, accepted = [], 0
    for token, _, from_draft in speculative_generate_step(
        mx.array(prompt), target, draft, num_draft_tokens=k, max_tokens=M
    ):
        ids.append(int(token))
        accepted += bool(from_draft)
    return ids, accepted


def measure(target: Path, draft: Path, k: int) -> dict:
    from mlx_lm.utils import load_model

    plan = compile_speculative(
        open_model(target), open_model(draft), CompileOptions(N, M, prefill_chunk=CHUNK), k
    )
    t, d = open_model_folder(target), open_model_folder(draft)
    plain = Session(plan, t)
    expected = [plain.generate(validate_request(plan, p, M)).tokens for p in PROMPTS]
    del plain
    mx.reset_peak_memory()
    spec = SpeculativeSession(plan, t, d)
    gens = [spec.generate(validate_request(plan, p, M)) for p in PROMPTS]
    peak = mx.get_peak_memory()
    del spec
    tm, _ = load_model(target)
    dm, _ = load_model(draft)
    ref = [mlx_lm_run(tm, dm, p, k) for p in PROMPTS]
    proposed = sum(g.proposed for g in gens)
    return {
        "k": k,
        "same_as_plain": all(g.tokens == e for g, e in zip(gens, expected, strict=True)),
        "same_as_mlx_lm": all(g.tokens == r[0] for g, r in zip(gens, ref, strict=True)),
        "acceptance": sum(g.accepted for g in gens) / proposed,
        # mlx-lm proposes as many draft tokens as the dctms runner when the ids agree.
        "mlx_lm_acceptance": sum(r[1] for r in ref) / proposed,
        "provable_over_observed": plan.envelope.provable / peak,
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ks", default="1,2,3,4")
    ap.add_argument("--layers", type=int, default=4, help="target layers (the draft keeps 1)")
    args = ap.parse_args()
    ks = [int(x) for x in args.ks.split(",")]
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        config = {**DEMO_CONFIG, "num_hidden_layers": args.layers}
        target = write_tiny_model(root / "target", config, seed=5, tokenizer=False)
        drafts = {"target itself": target, "first layer": first_layers(target, root / "d1", 1)}
        print(
            f"target: tiny qwen2, {args.layers} layers, hidden {config['hidden_size']}; "
            f"N {N}, M {M}, {len(PROMPTS)} prompts\n"
        )
        print("| draft | K | ids = plain runner | ids = mlx-lm | acceptance (dctms) "
              "| acceptance (mlx-lm) | provable / observed |")  # fmt: skip
        print("|---|---:|---|---|---:|---:|---:|")
        for name, draft in drafts.items():
            for k in ks:
                r = measure(target, draft, k)
                print(
                    f"| {name} | {k} | {'yes' if r['same_as_plain'] else 'NO'} | "
                    f"{'yes' if r['same_as_mlx_lm'] else 'NO'} | {r['acceptance']:.1%} | "
                    f"{r['mlx_lm_acceptance']:.1%} | {r['provable_over_observed']:.4f} |",
                    flush=True,
                )
    return 0


if __name__ == "__main__":
    sys.exit(main())
