"""Vision-language TTFT benchmark: overlapped vs serial vs mlx-vlm, for 1 and 2 images.

Usage: .venv/bin/python bench/vlm.py [--reps 5] [--families gemma3,qwen2_vl] [--text 160]
       [--out bench/results]

Per family it writes a random-weight folder of a mid-size model (nothing is downloaded), compiles
one plan with ``--overlap`` and measures time to first token, in one process, interleaved call by
call (A, B, C per repetition and prompt):

* A ``overlap``: the dctms runner on the plan, vision calls on a second MLX stream overlapping the
  prefill of the text before each image;
* B ``serial``: the same plan and session with ``serial=True`` (every image encoded first);
* C ``mlx-vlm``: mlx-vlm's own ``generate_step`` (its defaults: prefill step, greedy) on its own
  processor's inputs.

The prompts have ``--text`` tokens of text before each image, so there is prefill work to overlap.
TTFT counts from the processed inputs (pixel values, ids) to the first token for all three.
It prints medians and the ratios overlap/serial and overlap/mlx-vlm, checks that the three
systems' first tokens agree, and writes OUT/vlm_ttft.json.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

# Mid-size random models: enough work per call that two streams have something to overlap.
CONFIGS = {
    "gemma3": dict(
        options=dict(image_size=224, patch=14, tokens_per_image=64),
        text={"hidden_size": 256, "intermediate_size": 1024, "num_hidden_layers": 4,
              "num_attention_heads": 4, "head_dim": 64, "query_pre_attn_scalar": 64},
        vision={"hidden_size": 256, "intermediate_size": 1024, "num_hidden_layers": 4,
                "num_attention_heads": 4},
        bound=(224, 224),
        mark="<start_of_image>",
    ),
    "qwen2_vl": dict(
        options={},
        text={"hidden_size": 256, "intermediate_size": 1024, "num_hidden_layers": 4,
              "num_attention_heads": 4},
        vision={"embed_dim": 256, "depth": 4, "num_heads": 4, "hidden_size": 256},
        bound=(112, 112),
        mark="<|vision_start|><|image_pad|><|vision_end|>",
    ),
}


def make_folder(family: str, where: Path) -> Path:
    from dctms.toolkit.vision import tiny as vision_tiny

    spec = CONFIGS[family]
    base = vision_tiny.CONFIGS[family]

    def bigger(**options):
        config = base(**options)
        config["text_config"].update(spec["text"])
        config["vision_config"].update(spec["vision"])
        for key in ("hidden_size", "intermediate_size", "num_hidden_layers",
                    "num_attention_heads"):
            if key in config and key in spec["text"]:
                config[key] = spec["text"][key]
        if family == "qwen2_vl":
            config["rope_scaling"] = config["text_config"]["rope_scaling"] = {
                "type": "mrope", "mrope_section": [8, 12, 12]}
        return config

    vision_tiny.CONFIGS[family] = bigger
    try:
        return vision_tiny.write_tiny_vlm(where / family, family, **spec["options"])
    finally:
        vision_tiny.CONFIGS[family] = base


def images(where: Path, bound: tuple[int, int]) -> list[Path]:
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(0)
    out = []
    for k in range(2):
        path = where / f"bench{k}.png"
        Image.fromarray((rng.random((*bound, 3)) * 255).astype(np.uint8)).save(path)
        out.append(path)
    return out


def bench_family(family: str, reps: int, text_tokens: int, tmp: Path) -> dict:
    import mlx.core as mx
    from mlx_vlm.generate.ar import generate_step
    from mlx_vlm.utils import load_model, load_processor
    from PIL import Image

    from dctms.runner.load import load_checked_plan
    from dctms.runner.request import validate_request
    from dctms.runner.tokenize import Tokenizer
    from dctms.runner.vision_input import prepare, read_images
    from dctms.runner.vision_session import VisionSession
    from dctms.schema.io import write_plan
    from dctms.schema.model_folder import open_model, open_model_folder
    from dctms.toolkit.compiler import CompileOptions
    from dctms.toolkit.vision.compiler import VisionOptions, compile_vlm_plan

    spec = CONFIGS[family]
    folder = make_folder(family, tmp)
    pics = images(tmp, spec["bound"])
    n = 2 * (text_tokens + 80) + 16
    plan = compile_vlm_plan(
        open_model(folder),
        CompileOptions(n, 4, prefill_chunk=64, pack_seconds=0.5),
        VisionOptions(2, *spec["bound"], overlap=True),
    )
    write_plan(plan, tmp / f"{family}.plan")
    plan = load_checked_plan(tmp / f"{family}.plan")
    session = VisionSession(plan, open_model_folder(folder))
    model = load_model(folder)
    processor = load_processor(folder, add_detokenizer=False)
    foreign = sum(v.nbytes for _, v in __import__("mlx.utils").utils.tree_flatten(model.parameters()))
    session.apply_limits(foreign_bytes=foreign + 256 * 2**20)  # mlx-vlm's model beside ours
    tok = Tokenizer(folder)
    text = "the quick brown fox jumps over the lazy dog " * (text_tokens // 44 + 1)
    text = text[:text_tokens]
    results = {}
    for count in (1, 2):
        prompt = "".join(text + spec["mark"] for _ in range(count)) + "what is shown?"
        paths = pics[:count]
        ours = prepare(plan, folder, tok, prompt, read_images([str(p) for p in paths], plan))
        request = validate_request(plan, ours.prompt, 1, set())
        theirs = processor(text=[prompt], images=[Image.open(p).convert("RGB") for p in paths],
                           return_tensors="mlx")
        extra = {k: v for k, v in theirs.items()
                 if k not in ("input_ids", "pixel_values", "attention_mask")}

        def mlx_vlm_first(theirs=theirs, extra=extra):
            start = time.perf_counter()
            step = generate_step(theirs["input_ids"], model, theirs["pixel_values"],
                                 theirs["attention_mask"], max_tokens=1, temperature=0.0, **extra)
            token = int(next(step)[0])
            return time.perf_counter() - start, token

        def ours_first(serial: bool, request=request, ours=ours):
            gen = session.generate_vision(request, ours, serial=serial)
            return gen.ttft_s, gen.tokens[0]

        systems = {
            "overlap": lambda: ours_first(False),
            "serial": lambda: ours_first(True),
            "mlx-vlm": mlx_vlm_first,
        }
        for run in systems.values():  # warm-up: first calls check shapes, compile kernels
            run()
        times = {name: [] for name in systems}
        firsts = {}
        for _ in range(reps):
            for name, run in systems.items():
                seconds, token = run()
                times[name].append(seconds)
                firsts[name] = token
                mx.clear_cache()
        med = {name: statistics.median(t) for name, t in times.items()}
        results[f"{count} image{'s' if count > 1 else ''}"] = {
            "prompt_tokens": len(ours.prompt),
            "median_ttft_s": med,
            "overlap_over_serial": med["overlap"] / med["serial"],
            "overlap_over_mlx_vlm": med["overlap"] / med["mlx-vlm"],
            "serial_over_mlx_vlm": med["serial"] / med["mlx-vlm"],
            "first_tokens": firsts,
            "agree": len(set(firsts.values())) == 1,
        }
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--families", default="gemma3,qwen2_vl")
    parser.add_argument("--text", type=int, default=160, help="text tokens before each image")
    parser.add_argument("--out", default=str(ROOT / "bench" / "results"))
    args = parser.parse_args()
    report = {}
    with tempfile.TemporaryDirectory(prefix="dctms-bench-vlm-") as tmp:
        for family in args.families.split(","):
            report[family] = bench_family(family, args.reps, args.text, Path(tmp))
    print(f"{'family':<10}{'images':>8}{'tokens':>8}{'overlap s':>11}{'serial s':>10}"
          f"{'mlx-vlm s':>11}{'ovl/ser':>9}{'ovl/mlx-vlm':>13}{'agree':>7}")
    for family, rows in report.items():
        for label, r in rows.items():
            m = r["median_ttft_s"]
            print(f"{family:<10}{label.split()[0]:>8}{r['prompt_tokens']:>8}{m['overlap']:>11.4f}"
                  f"{m['serial']:>10.4f}{m['mlx-vlm']:>11.4f}{r['overlap_over_serial']:>9.3f}"
                  f"{r['overlap_over_mlx_vlm']:>13.3f}{str(r['agree']):>7}")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "vlm_ttft.json").write_text(json.dumps(report, indent=2, sort_keys=True) + "\n")
    print(f"wrote {out / 'vlm_ttft.json'}")


if __name__ == "__main__":
    main()
