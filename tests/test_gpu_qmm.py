"""What a quantised matmul's GPU kernels allocate (schema.gpu_qmm), from MLX's source, in the plan."""

from __future__ import annotations

import pytest

from dctms.schema.gpu_qmm import (
    cuda_qmm_copies,
    gpu_qmm_scratch,
    lowest_qmv_limit,
    qmm_partials,
    qmm_split_k,
)
from dctms.schema.model_folder import model_from_config
from dctms.schema.targets import counted, derive
from dctms.schema.verify import verify_plan
from dctms.toolkit.compiler import CompileOptions, compile_plan
from dctms.toolkit.tiny_model import DEMO_CONFIG

AFFINE_T = [64, 4, "affine", True]  # group_size, bits, mode, transpose (an mlx-lm Linear)


# Worked by hand from quantized.cpp:1133-1152: tiles = ceil(N/32) * ceil(M/32); split =
# max(1, 512 // tiles), at most K // max(group_size, 32), lowered until K % (split * align) == 0.
@pytest.mark.parametrize(
    ("m", "n", "k", "group", "split"),
    [
        (64, 1536, 1536, 64, 4),  # 96 tiles: 5, 1536 % 320 != 0, 4
        (64, 256, 1536, 64, 24),  # 16 tiles: 32, capped at 1536 // 64 = 24
        (64, 8960, 1536, 64, 1),  # 560 tiles: 512 // 560 = 0 -> 1, plain qmm
        (32, 352, 128, 32, 4),  # 11 tiles: 46, capped at 128 // 32 = 4
        (32, 352, 96, 64, 1),  # 96 // 64 = 1
    ],
)
def test_split_k_follows_mlxs_arithmetic(m, n, k, group, split) -> None:
    assert qmm_split_k(m, n, k, group) == split


def test_the_lowest_qmv_limit_over_every_apple_gpu() -> None:
    # get_qmv_batch_limit (quantized.cpp:85-141): min over its branches for each size class
    assert [lowest_qmv_limit(2048, 2048), lowest_qmv_limit(4096, 2049), lowest_qmv_limit(4097, 8)] == [
        13,
        10,
        6,
    ]


def test_partials_where_metal_splits_and_none_elsewhere() -> None:
    # a prefill chunk against q_proj: [4, 64, 1536] partials of float16
    assert qmm_partials((1, 64, 1536), (1536, 192), (1, 64, 1536), 2, AFFINE_T) == 4 * 64 * 1536 * 2
    # a decode row and a 12-row batch go to qmv on every GPU (12 < 13)
    assert qmm_partials((1, 1, 1536), (1536, 192), (1, 1, 1536), 2, AFFINE_T) == 0
    assert qmm_partials((12, 1, 1536), (1536, 192), (12, 1, 1536), 2, AFFINE_T) == 0
    # 13 rows read as one row-contiguous matrix (a 2-D weight): split, though x.shape(-2) is 1
    assert qmm_partials((13, 1, 1536), (1536, 192), (13, 1, 1536), 2, AFFINE_T) > 0
    # too many tiles: plain qmm
    assert qmm_partials((1, 64, 1536), (8960, 192), (1, 64, 8960), 2, AFFINE_T) == 0
    # not transposed: qvm_split_k below 4 rows from K = 1024 (8 parts; 32 past K = 8192)
    plain = [64, 4, "affine", False]
    assert qmm_partials((1, 1, 2048), (2048, 64), (1, 1, 512), 4, plain) == 8 * 512 * 4
    assert qmm_partials((1, 1, 9000), (9000, 64), (1, 1, 512), 4, plain) == 32 * 512 * 4
    assert qmm_partials((1, 1, 1000), (1000, 64), (1, 1, 512), 4, plain) == 0
    assert qmm_partials((1, 4, 2048), (2048, 64), (1, 4, 512), 4, plain) == 0


def test_a_quantised_caches_attention_values_split_over_long_windows() -> None:
    # mlx-lm's quantized_scaled_dot_product_attention: probabilities [B, kv heads, repeats, L, S]
    # times the packed values [B, kv heads, 1, S, D * bits / 32], not transposed. One query row
    # over 2,048 positions: qvm_split_k's 8 parts of the [1, 2, 2, 1, 64] output; 512: qvm.
    plain = [64, 4, "affine", False]
    out = (1, 2, 2, 1, 64)
    assert qmm_partials((1, 2, 2, 1, 2048), (1, 2, 1, 2048, 8), out, 2, plain) == 8 * 256 * 2
    assert qmm_partials((1, 2, 2, 1, 512), (1, 2, 1, 512, 8), out, 2, plain) == 0


def test_each_target_charges_its_own_as_its_allocator_counts() -> None:
    ins = [(1, 64, 1536), (1536, 192), (1536, 24), (1536, 24)]  # x, w, scales, biases
    dtypes = ["float16", "uint32", "float16", "float16"]
    out = (1, 64, 1536)
    metal, cuda = derive("metal", "apple-m4-16gb"), derive("cuda", "nvidia-h100-sxm")
    assert gpu_qmm_scratch(metal, ins, dtypes, out, AFFINE_T) == counted(metal, 4 * 64 * 1536 * 2)
    copy = 1536 * 24 * 2  # qmm_sm90 transposes the scales and the biases
    assert gpu_qmm_scratch(cuda, ins, dtypes, out, AFFINE_T) == 2 * counted(cuda, copy)
    assert gpu_qmm_scratch(None, ins, dtypes, out, AFFINE_T) == 0


def test_cuda_copies_only_where_qmm_sm90_runs() -> None:
    ins = [(1, 64, 1536), (1536, 192), (1536, 24), (1536, 24)]
    dtypes = ["float16", "uint32", "float16", "float16"]
    assert cuda_qmm_copies(ins, dtypes, (1, 64, 1536), AFFINE_T) == [73728, 73728]
    one_row = [(1, 1, 1536), *ins[1:]]
    assert cuda_qmm_copies(one_row, dtypes, (1, 1, 1536), AFFINE_T) == []  # qmv
    assert cuda_qmm_copies(ins[:3], dtypes[:3], (1, 64, 1536), AFFINE_T) == []  # no biases
    assert cuda_qmm_copies(ins, dtypes, (1, 64, 1536), [64, 4, "affine", False]) == []
    odd_k = [(1, 64, 1504), (1536, 188), (1536, 24), (1536, 24)]
    assert cuda_qmm_copies(odd_k, dtypes, (1, 64, 1536), AFFINE_T) == []  # K % 64 != 0


QUANTISED = {**DEMO_CONFIG, "quantization": {"group_size": 32, "bits": 4}}


def _gpu_plan(target: str):
    opts = CompileOptions(input_tokens=32, output_tokens=8, target=target, pack_seconds=0.0)
    return compile_plan(model_from_config(QUANTISED), opts)


@pytest.fixture(scope="module")
def metal_plan():
    return _gpu_plan("metal")


def test_a_metal_plan_charges_its_prefills_quantised_matmuls(metal_plan) -> None:
    assert verify_plan(metal_plan, for_run=False) == []
    phases = {p.name: p for p in metal_plan.phases}
    prefill = phases["prefill"]
    shape = {t.id: t.shape for t in prefill.tensors} | {b.id: b.shape for b in prefill.inputs}
    qmm = [op for op in prefill.ops if op.primitive == "QuantizedMatmul"]
    rows = [shape[op.inputs[0]][-2] for op in qmm]
    assert sorted(set(rows)) == [1, 32]  # the last layer and the head work on the last row only
    # 32 rows split on every Apple GPU, one row runs qmv
    assert [op.scratch > 0 for op in qmm] == [r == 32 for r in rows]
    decode = [op for op in phases["decode"].ops if op.primitive == "QuantizedMatmul"]
    assert decode and all(op.scratch == 0 for op in decode)
    cpu = compile_plan(
        model_from_config(QUANTISED), CompileOptions(input_tokens=32, output_tokens=8, pack_seconds=0.0)
    )
    cpu_scratch = {op.primitive: 0 for op in cpu.phases[0].ops}
    for op in cpu.phases[0].ops:
        cpu_scratch[op.primitive] += op.scratch
    assert sum(op.scratch for op in qmm) > cpu_scratch["QuantizedMatmul"]


def test_a_cuda_plan_charges_its_prefills_quantised_matmuls_the_copies() -> None:
    plan = _gpu_plan("cuda")
    assert verify_plan(plan, for_run=False) == []
    prefill = plan.phases[0]
    shape = {t.id: t.shape for t in prefill.tensors} | {b.id: b.shape for b in prefill.inputs}
    shape |= {c.id: c.shape for c in prefill.constants}
    for op in (op for op in prefill.ops if op.primitive == "QuantizedMatmul"):
        rows = shape[op.inputs[0]][-2]
        # 32 rows of K = 128 (a multiple of 64): qmm_sm90 copies scales and biases; one row: qmv
        assert (op.scratch > 0) == (rows == 32 and shape[op.inputs[0]][-1] % 64 == 0), op


@pytest.mark.parametrize("target", ["metal", "cuda"])
def test_the_verifier_refuses_a_quantised_matmul_charged_less(metal_plan, target) -> None:
    from test_gpu_matmul import lowered_scratch_problems

    plan = metal_plan if target == "metal" else _gpu_plan("cuda")
    (problem,) = lowered_scratch_problems(plan, "QuantizedMatmul")
    assert ("partial sums" if target == "metal" else "transposed scales") in problem.message
