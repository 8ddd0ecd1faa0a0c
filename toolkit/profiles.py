"""Roofline target profiles for the scheduler's bandwidth constraint, each figure with its source.

An op is *memory-bound* when its arithmetic intensity (FLOPs per byte moved) is below the ridge
point ``peak_flops / bandwidth``; the scheduler keeps at most one such op per slot so concurrent ops
never fight over memory bandwidth (paper §3.5).
"""

from __future__ import annotations

from dctms.figures.roofline import CPU_OPENBLAS
from dctms.schema.errors import DctmsError
from dctms.schema.types import TargetProfile


def _apple(
    name: str, flops: float, flops_source: str, bandwidth: float, bandwidth_source: str
) -> TargetProfile:
    return TargetProfile(name, flops, flops_source, bandwidth, bandwidth_source)


PROFILES: dict[str, TargetProfile] = {
    "cpu-x86-2core": TargetProfile(
        name="cpu-x86-2core",
        peak_flops=4.5e9,
        peak_flops_source=(
            "measured: best of 3 MLX CPU float32 2048x2048 matmuls on the 2-core AVX-512 Xeon "
            "this project is developed on, 4.5 GFLOP/s (dctms roofline --measure re-measures)"
        ),
        bandwidth_bytes_per_s=21.0e9,
        bandwidth_source=(
            "measured: best of 10 numpy copies of 256 MiB on the same machine, 21 GB/s "
            "read+write (dctms roofline --measure re-measures)"
        ),
    ),
    "apple-m4-16gb": TargetProfile(
        name="apple-m4-16gb",
        peak_flops=4.1e12,
        peak_flops_source=(
            "derived: Apple M4 10-core GPU = 1280 FP32 ALUs x 2 FLOP/FMA x ~1.6 GHz; Apple "
            "publishes core counts, not a FLOP figure"
        ),
        bandwidth_bytes_per_s=120e9,
        bandwidth_source="published: Apple M4 tech specs, 120 GB/s unified memory bandwidth",
    ),
    **{
        name: _apple(name, *figures)
        for name, figures in {
            "apple-m1": (
                2.6e12,
                "published: Apple newsroom 'Apple unleashes M1' (2020-11-10), 8-core GPU "
                "'2.6 teraflops of throughput'",
                68.25e9,
                "derived: 128-bit LPDDR4X-4266 = 16 bytes x 4.266 GT/s = 68.25 GB/s (Apple "
                "publishes no M1 bandwidth figure)",
            ),
            "apple-m1-pro": (
                5.2e12,
                "published: Apple event 2021-10-18, M1 Pro 16-core GPU '5.2 teraflops'",
                200e9,
                "published: Apple newsroom 'Introducing M1 Pro and M1 Max' (2021-10-18), "
                "'up to 200GB/s of memory bandwidth'",
            ),
            "apple-m1-max": (
                10.4e12,
                "published: Apple event 2021-10-18, M1 Max 32-core GPU '10.4 teraflops'",
                400e9,
                "published: Apple newsroom 'Introducing M1 Pro and M1 Max' (2021-10-18), "
                "'up to 400GB/s of memory bandwidth'",
            ),
            "apple-m4-pro": (
                8.2e12,
                "derived: Apple M4 Pro 20-core GPU = 2560 FP32 ALUs x 2 FLOP/FMA x ~1.6 GHz "
                "(as apple-m4-16gb); Apple publishes core counts, not a FLOP figure",
                273e9,
                "published: Apple newsroom 'Apple introduces M4 Pro and M4 Max' (2024-10-30), "
                "M4 Pro '273GB/s of memory bandwidth'",
            ),
            "apple-m4-max": (
                16.4e12,
                "derived: Apple M4 Max 40-core GPU = 5120 FP32 ALUs x 2 FLOP/FMA x ~1.6 GHz "
                "(as apple-m4-16gb); Apple publishes core counts, not a FLOP figure",
                546e9,
                "published: Apple newsroom 'Apple introduces M4 Pro and M4 Max' (2024-10-30), "
                "M4 Max (40-core GPU) '546GB/s of memory bandwidth'",
            ),
        }.items()
    },
}

# NVIDIA GPUs (the cuda target), FP32 figures as for the Apple GPUs, from NVIDIA's datasheets.
_NVIDIA = {
    "nvidia-a100-sxm": (
        19.5e12,
        "published: NVIDIA A100 Tensor Core GPU datasheet, FP32 19.5 TFLOPS",
        2039e9,
        "published: NVIDIA A100 datasheet, A100 80GB SXM GPU memory bandwidth 2,039 GB/s",
    ),
    "nvidia-h100-sxm": (
        67e12,
        "published: NVIDIA H100 Tensor Core GPU datasheet, H100 SXM FP32 67 teraFLOPS",
        3.35e12,
        "published: NVIDIA H100 datasheet, H100 SXM GPU memory bandwidth 3.35 TB/s",
    ),
    "nvidia-h200-sxm": (
        67e12,
        "published: NVIDIA H200 Tensor Core GPU datasheet, H200 SXM FP32 67 TFLOPS",
        4.8e12,
        "published: NVIDIA H200 datasheet, H200 SXM GPU memory bandwidth 4.8 TB/s",
    ),
}
PROFILES.update({name: TargetProfile(name, *figures) for name, figures in _NVIDIA.items()})

# The CPU profile predictions use by default (figures.roofline.prediction_profile); choosable here.
PROFILES[CPU_OPENBLAS.name] = CPU_OPENBLAS

DEFAULT_PROFILE = {"cpu": "cpu-x86-2core", "gpu": "apple-m4-16gb"}


def get_profile(name: str) -> TargetProfile:
    try:
        return PROFILES[name]
    except KeyError:
        known = ", ".join(sorted(PROFILES))
        raise DctmsError(f"unknown target profile {name!r} (known: {known})") from None


def ridge_point(profile: TargetProfile) -> float:
    return profile.peak_flops / profile.bandwidth_bytes_per_s
