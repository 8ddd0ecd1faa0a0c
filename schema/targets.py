"""Target memory models: what MLX's GPU allocators count for a request, and how long they hold it.

Written from MLX's source (ml-explore/mlx, tag v0.32.1; the files cited are unchanged up to the
0.32.4 wheel this project pins), *not measured*: no GPU is attached to the machines this project's
tests run on. ``dctms selftest --backend gpu`` is how a user confirms a model on their own GPU.

The compiler records a ``MemoryModel`` in a GPU plan's target; the verifier re-derives every figure
of it from its name, its MLX version and the target profile (``rules_target``), and the rules below
(rounding, cache reuse, command-buffer lifetime) from the model, so a plan cannot claim another
allocator than the one it names. ``cpu`` keeps the model of ``dctms.toolkit.memory_model`` and
records no ``MemoryModel`` (MLX's CPU allocator, with the buffer cache the runner disables).

**metal** (mlx/backend/metal/allocator.cpp, mlx/backend/common/buffer_cache.h):

* a request above the 16 KiB page is rounded up to whole pages (allocator.cpp:123-126); one at or
  below it keeps its size (``MTLBuffer.length`` is what ``active_memory_`` adds, allocator.cpp:166);
* requests under 256 B come from a 1 MiB heap (allocator.h:48-52, allocator.cpp:148-150): counted
  the same way, so the heap changes where a buffer lives, not what MLX counts;
* a cached buffer of size s serves a request of (rounded) size n when n <= s < min(2n, n + 2 pages)
  (buffer_cache.h:30-36) and then counts s (allocator.cpp:130, 166): up to min(n, 2 pages) - 1 more;
* every input of an op is held until the command buffer it was encoded in completes
  (mlx/backend/metal/eval.cpp:47-68); a command buffer is committed after the op that takes it past
  ``max_ops_per_buffer`` kernel dispatches (device.cpp:408-421, 511-514; 20/40/50 by GPU class,
  device.cpp:602-623, ``MLX_MAX_OPS_PER_BUFFER`` overrides) or 40-50 MB of inputs (which only
  commits sooner); after each op the host waits while more than ``MAX_ACTIVE_TASKS`` = 10 committed
  buffers are outstanding (mlx/transforms.cpp:25, 271-285). So while the host encodes op j, the
  command buffers not yet completed are the open one and at most 10 committed ones, each of at most
  ``max_ops_per_buffer`` + 1 ops that dispatch a kernel: a tensor read last by op k may still be
  held at op j when fewer than (10 + 1) x (max_ops_per_buffer + 1) kernel ops lie between them;
* more than 499,000 live buffers throw (device_info.cpp:41, allocator.cpp:140-146).

Fused kernels (``mx.fast.rms_norm``, ``rope``, ``scaled_dot_product_attention``) are one plan op
each on both GPU targets (``toolkit.fused_kernels`` substitutes them for the CPU trace's
composites); what each may hold besides its output is ``schema.fast_ops``: on Metal the kernel's
own buffers (attention's input copies and two-pass partials) or, for shapes its kernel does not
take, the composite's intermediates.

**cuda** (mlx/backend/cuda/allocator.cpp): a request of at most 8 B takes an 8-byte block of a
small pool (allocator.cpp:24-29, 171-172, 195-197), one under the 16 KiB page is rounded up to a
power of two (173-174), a larger one to whole pages (175-176); the same buffer cache (185, 143-146)
and ``active_memory_ += buf->size`` (237). Inputs are held until the CUDA graph they were added to
completes (mlx/backend/cuda/eval.cpp:60-76, device.cpp:463-467); a graph is committed past
``max_ops_per_graph`` kernel nodes (device.cpp:458-461; 20, or 100 on H100/B200/consumer
Blackwell, device.cpp:181-202): the profile's (``cuda-nvidia-a100-sxm``: 20), else the largest. The CUDA context, the
``cudaMallocAsync`` pools' reserve and CUDA graphs' own memory are outside MLX's count.
"""

from __future__ import annotations

from dctms.schema.aliasing import RESHAPES, VIEW_ALWAYS
from dctms.schema.types import MemoryModel

MLX_SOURCE = "0.32"  # the MLX minor whose allocator source the models follow
SUPPORTED_MLX = (MLX_SOURCE,)  # the minors whose export format and allocators dctms knows
PAGE = 16384  # Metal's vm_page_size on Apple silicon; cuda::page_size (allocator.cpp:22)
MAX_ACTIVE_TASKS = 10  # mlx/transforms.cpp:25
METAL_SMALL = 256  # MetalAllocator::small_size_ (allocator.h:51): below it, the 1 MiB heap
CUDA_SMALL = 8  # cu::small_block_size (allocator.cpp:25): at most it, the small pool
METAL_RESOURCE_LIMIT = 499_000  # metal device_info.cpp:41

# Metal's default ops per command buffer by the GPU's class letter (device.cpp:602-623), and the
# class of each Apple profile: 'g' base and Pro chips, 's' Max, 'd' Ultra.
METAL_OPS = {"p": 20, "g": 40, "s": 50, "d": 50}
APPLE_CLASS = {
    "apple-m1": "g",
    "apple-m1-pro": "g",
    "apple-m1-max": "s",
    "apple-m4-16gb": "g",
    "apple-m4-pro": "g",
    "apple-m4-max": "s",
}
# CUDA's default kernel ops per graph by compute capability (get_graph_limits, device.cpp:181-202):
# 20 by default and on A100 (8.0), 100 on H100/H200 (9.0), B200 and consumer Blackwell; a profile
# naming no NVIDIA GPU gets the largest.
CUDA_OPS = {"nvidia-a100-sxm": 20, "nvidia-h100-sxm": 100, "nvidia-h200-sxm": 100}

NOT_MODELLED = {
    "metal": [
        "temporaries the GPU kernels allocate themselves (multi-pass reductions and sorts; "
        "matmuls' split-K partials are modelled)",
        "MLX_MAX_OPS_PER_BUFFER / MLX_MAX_MB_PER_BUFFER set above their defaults",
        "running into MLX's memory limit (set_memory_limit makes the host wait, it is no cap)",
    ],
    "cuda": [
        "which attention path MLX's cuda backend takes and cuDNN's workspace (a fused op is "
        "charged the larger of its composite's and a kernel's copies of every input)",
        "temporaries the GPU kernels allocate themselves (split-K matmul partials, multi-pass "
        "reductions and sorts; a quantised matmul's transposed scales and biases are modelled)",
        "MLX_MAX_OPS_PER_BUFFER / MLX_MAX_MB_PER_BUFFER set above their defaults",
        "running into MLX's memory limit",
        "the CUDA context, cudaMallocAsync pool reserve and CUDA graphs (outside MLX's count)",
    ],
}
GPU_TARGETS = tuple(NOT_MODELLED)  # "metal", "cuda"
TARGETS = ("cpu", *GPU_TARGETS)
# The roofline profile a target gets when none is named (profiles are the toolkit's; names here).
DEFAULT_TARGET_PROFILE = {"metal": "apple-m4-16gb", "cuda": "nvidia-h100-sxm"}


# Primitives that may encode no kernel on the GPU (a view, a reshape MLX may do as a view, an AsType
# to its own dtype): counted as 0 kernel ops, so a command buffer may hold any number of them (the
# safe side: fewer counted ops widen lifetimes further). An op whose outputs are all views or all
# empty counts 0 too; every other op at least 1 (``kernel_ops``).
NO_KERNEL = VIEW_ALWAYS | RESHAPES | {"AsType"}


def kernel_ops(primitive: str, views_only: bool, empty: bool) -> int:
    """The kernel ops the budget counts for one op (a lower bound on its kernel dispatches)."""
    return 0 if primitive in NO_KERNEL or views_only or empty else 1


def ops_per_buffer(name: str, profile: str) -> int:
    """MLX's default kernel ops per command buffer (metal) or graph (cuda) for ``profile``: the
    profile's GPU class on Metal, the largest class when the profile names none."""
    if name == "metal":
        cls = APPLE_CLASS.get(profile)
        return METAL_OPS[cls] if cls is not None else max(METAL_OPS.values())
    return CUDA_OPS.get(profile, max(CUDA_OPS.values()))


def derive(name: str, profile: str) -> MemoryModel:
    """The model a plan for target ``name`` with roofline ``profile`` records."""
    return MemoryModel(
        name=name,  # type: ignore[arg-type]
        mlx=MLX_SOURCE,
        page_bytes=PAGE,
        small_bytes=METAL_SMALL if name == "metal" else CUDA_SMALL,
        ops_per_buffer=ops_per_buffer(name, profile),
        active_tasks=MAX_ACTIVE_TASKS,
        not_modelled=list(NOT_MODELLED[name]),
    )


def rounded(model: MemoryModel, n: int) -> int:
    """The size MLX's allocator asks for a request of ``n`` bytes (0: no buffer)."""
    page = model.page_bytes
    if n <= 0:
        return 0
    if model.name == "metal":
        return -(-n // page) * page if n > page else n
    if n <= model.small_bytes:
        return model.small_bytes
    if n < page:
        return 1 << (n - 1).bit_length()
    return -(-n // page) * page


def counted(model: MemoryModel, n: int) -> int:
    """The most bytes MLX's active memory counts for an ``n``-byte request: its rounded size r, or a
    cached buffer below min(2 r, r + 2 pages) (buffer_cache.h:33-34)."""
    r = rounded(model, n)
    return max(r, min(2 * r, r + 2 * model.page_bytes) - 1)


def overhead(model: MemoryModel | None, n: int, allocator_slack: int = 0) -> int:
    """Bytes an ``n``-byte tensor may cost beyond ``n``: the model's rounding and reuse, or, without
    a model (the CPU's, or a GPU plan traced natively), the plan's ``allocator_slack``."""
    if model is None:
        return min(n, allocator_slack) if allocator_slack > 0 else 0
    return counted(model, n) - n


def run_ahead_budget(model: MemoryModel) -> int:
    """Kernel ops that may lie between a tensor's last read and the op the host encodes while it is
    still held: the open command buffer and ``active_tasks`` committed ones, each of at most
    ``ops_per_buffer`` + 1 kernel ops."""
    return (model.active_tasks + 1) * (model.ops_per_buffer + 1)


def allocator_slack(model: MemoryModel) -> int:
    """``Target.allocator_slack`` of a GPU plan: the reuse bound's 2 pages (as before the models)."""
    return 2 * model.page_bytes


def installed_mlx() -> str | None:
    """The installed MLX's version, from its package metadata (MLX itself is not imported)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("mlx")
    except PackageNotFoundError:
        return None


def mlx_refusal() -> str | None:
    """Why the installed MLX cannot be used by a command that runs it, or None."""
    found = installed_mlx()
    if found is None:
        return (
            "MLX is not installed: pip install 'dctms[cpu]' (Linux, MLX on the CPU) or "
            "'dctms[cuda]' (Linux, NVIDIA GPUs); on macOS 'dctms' brings MLX with Metal"
        )
    return unsupported_mlx(found)


def mlx_minor(version: str) -> str:
    return ".".join(version.split(".")[:2])


def unsupported_mlx(version: str) -> str | None:
    """Why this MLX cannot be used (its export format and allocators are unknown), or None."""
    if mlx_minor(version) in SUPPORTED_MLX:
        return None
    known = ", ".join(f"{m}.x" for m in SUPPORTED_MLX)
    return (
        f"mlx {version} is not supported: dctms knows the export format and allocators of mlx "
        f"{known} only (pip install 'dctms[cpu]' or 'dctms[cuda]' installs a supported one)"
    )
