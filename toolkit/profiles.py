"""Roofline target profiles for the scheduler's bandwidth constraint, each figure with its source.

An op is *memory-bound* when its arithmetic intensity (FLOPs per byte moved) is below the ridge
point ``peak_flops / bandwidth``; the scheduler keeps at most one such op per slot so concurrent ops
never fight over memory bandwidth (paper §3.5).
"""

from __future__ import annotations

from dctms.schema.errors import DctmsError
from dctms.schema.types import TargetProfile

PROFILES: dict[str, TargetProfile] = {
    "cpu-x86-2core": TargetProfile(
        name="cpu-x86-2core",
        peak_flops=4.5e9,
        peak_flops_source=(
            "measured: best of 3 MLX CPU float32 2048x2048 matmuls on the 2-core AVX-512 Xeon "
            "this project is developed on (bench/roofline.py), 4.5 GFLOP/s"
        ),
        bandwidth_bytes_per_s=21.0e9,
        bandwidth_source=(
            "measured: best of 10 numpy copies of 256 MiB on the same machine "
            "(bench/roofline.py), 21 GB/s read+write"
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
}

DEFAULT_PROFILE = {"cpu": "cpu-x86-2core", "gpu": "apple-m4-16gb"}


def get_profile(name: str) -> TargetProfile:
    try:
        return PROFILES[name]
    except KeyError:
        known = ", ".join(sorted(PROFILES))
        raise DctmsError(f"unknown target profile {name!r} (known: {known})") from None


def ridge_point(profile: TargetProfile) -> float:
    return profile.peak_flops / profile.bandwidth_bytes_per_s
