"""Metal's unquantised matmul temporaries (schema.gpu_matmul), from MLX's source, in the plan."""

from __future__ import annotations

import pytest
from msgspec.structs import replace

from dctms.schema.gpu_matmul import gpu_matmul_scratch, matmul_partials
from dctms.schema.model_folder import model_from_config
from dctms.schema.targets import counted, derive
from dctms.schema.verify import verify_plan
from dctms.toolkit.compiler import CompileOptions, compile_plan
from dctms.toolkit.tiny_model import DEMO_CONFIG

F32 = 4


# Worked by hand from matmul.cpp: steel_gemm_splitk_axpby when 16 x 16 tiles <= 2,048, K / 16 >= 8
# and K >= max(M, N), split = min(max(2, next_pow2((K / 16) / 32 x 32 tiles)), 32); the NAX split
# when K >= 3 max(M, N) (or max <= 1024 and K > 2 max), ceil(K / part) parts.
@pytest.mark.parametrize(
    ("a", "b", "want"),
    [
        # 8 rows of 4,096 by 4,096 (a batched decode step): 256 tiles; split max(2, pow2(256/128)) = 2
        ((8, 4096), (4096, 4096), 2 * 8 * 4096 * F32),
        # 32 rows of 4,096 by 256: 32 tiles, split pow2(256 // 8) = 32; NAX: 4096 >= 768, 2 parts
        ((32, 4096), (4096, 256), 32 * 32 * 256 * F32),
        # 512 rows by 4,096 columns: 8,192 tiles, no SIMD split; NAX needs K >= 12,288: none
        ((512, 4096), (4096, 4096), 0),
        # K shorter than the output side: none
        ((64, 64), (64, 1024), 0),
        # a batch of 4 attention heads, 16 x 64 by 64 x 16: batched (no split) or folded into 64
        # rows (64 x 16 output, 4 x 1 tiles, K = 64 < 128: no SIMD split; NAX: 64 < 192: none)
        ((4, 16, 64), (4, 64, 16), 0),
        # one row by one column: dot_product's block sums (1 block) and a float32 result
        ((1, 2048), (2048, 1), 1 * F32 + 1 * F32),
        # one row by many columns: a gemv, nothing
        ((1, 4096), (4096, 4096), 0),
    ],
)
def test_matmul_partials_follow_mlxs_dispatch(a, b, want) -> None:
    out = (*a[:-1], b[-1])
    assert matmul_partials("Matmul", a, b, out) == want


def test_a_batch_folded_into_rows_is_counted_too() -> None:
    # [2, 4, 4096] by a shared [4096, 4096]: MLX folds the batch into 8 rows when the strides allow
    out = (2, 4, 4096)
    assert matmul_partials("Matmul", (2, 4, 4096), (4096, 4096), out) == 2 * 8 * 4096 * F32


def test_only_metal_charges_an_unquantised_matmul() -> None:
    a, b, out = (8, 4096), (4096, 4096), (8, 4096)
    metal = derive("metal", "apple-m4-16gb")
    got = gpu_matmul_scratch(metal, "AddMM", [a, b, (4096,)], ["float16"] * 3, out, [1.0, 1.0])
    assert got == counted(metal, 2 * 8 * 4096 * F32)
    cuda = derive("cuda", "nvidia-h100-sxm")
    assert gpu_matmul_scratch(cuda, "Matmul", [a, b], ["float16"] * 2, out, []) == 0
    assert gpu_matmul_scratch(None, "Matmul", [a, b], ["float16"] * 2, out, []) == 0


@pytest.fixture(scope="module")
def metal_float_plan():
    config = {**DEMO_CONFIG, "hidden_size": 256, "intermediate_size": 512}
    opts = CompileOptions(input_tokens=32, output_tokens=8, target="metal", pack_seconds=0.0)
    return compile_plan(model_from_config(config), opts)


def test_a_metal_float_plan_charges_its_split_matmuls_and_verifies(metal_float_plan) -> None:
    assert verify_plan(metal_float_plan, for_run=False) == []
    prefill = metal_float_plan.phases[0]
    known = {t.id: t.shape for t in prefill.tensors} | {b.id: b.shape for b in prefill.inputs}
    known |= {c.id: c.shape for c in prefill.constants}
    split = [
        op for op in prefill.ops
        if op.primitive == "Matmul"
        and matmul_partials("Matmul", known[op.inputs[0]], known[op.inputs[1]], known[op.outputs[0]])
    ]  # fmt: skip
    assert split and all(op.scratch > 0 for op in split)


def lowered_scratch_problems(plan, primitive: str) -> list:
    """The verifier's ``gpu_matmul`` findings once the first ``primitive`` op of the first phase
    that is charged scratch claims one byte less; exactly one, at that op (asserted here)."""
    phase = plan.phases[0]
    k = next(i for i, op in enumerate(phase.ops) if op.primitive == primitive and op.scratch)
    ops = list(phase.ops)
    ops[k] = replace(ops[k], scratch=ops[k].scratch - 1)
    broken = replace(plan, phases=[replace(phase, ops=ops), *plan.phases[1:]])
    problems = [p for p in verify_plan(broken, for_run=False) if p.rule == "gpu_matmul"]
    assert len(problems) == 1 and f"ops[{k}].scratch" in problems[0].path
    return problems


def test_the_verifier_refuses_a_split_matmul_charged_less(metal_float_plan) -> None:
    (problem,) = lowered_scratch_problems(metal_float_plan, "Matmul")
    assert "Matmul" in problem.message and "split-K" in problem.message
