"""Which BLAS MLX's CPU matmuls run on, and the switch to an optimised one on Linux.

MLX's Linux CPU wheel (``mlx[cpu]``) links the netlib *reference* BLAS it carries in
``mlx_cpu.libs/libblas-*.so*`` (~8 GFLOP/s fp32 GEMM here, 20-30x slower than OpenBLAS). The dynamic
linker binds a symbol to the first object in its global scope that defines it, and a library named
in ``LD_PRELOAD`` comes before every library MLX loads, so preloading Debian's OpenBLAS
(``libopenblas0-pthread``) makes every ``cblas_sgemm`` MLX calls OpenBLAS's. ``LD_PRELOAD`` is read
only when a process starts, hence :func:`reexec_with_fast_blas`: the ``dctms`` entry point replaces
itself (``execve``, same pid, same stdin/stdout/stderr and signals, the exit status is the new
program's) once with the variable set. ``DCTMS_BLAS=off`` keeps MLX's own BLAS.

:func:`loaded_blas` reports what really runs: the library that defines ``cblas_sgemm`` in the
process's global scope (preloaded or linked globally), else the BLAS mapped into the process
(``/proc/self/maps``) that MLX loaded for itself. Nothing here imports MLX.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import glob
import os
import platform
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from importlib.util import find_spec

from dctms.schema.errors import DctmsError

SWITCH = "DCTMS_BLAS"  # "auto" (default): preload OpenBLAS when it helps; "off": MLX's own BLAS
REEXEC_MARK = "DCTMS_BLAS_REEXEC"  # set in the re-executed process: never re-execute twice
SWITCH_VALUES = ("auto", "off")
APT_PACKAGE = "libopenblas0-pthread"


def openblas_path() -> str:
    """Debian's pthread OpenBLAS (package libopenblas0-pthread) for this machine's multiarch."""
    arch = {"x86_64": "x86_64", "amd64": "x86_64", "aarch64": "aarch64", "arm64": "aarch64"}.get(
        platform.machine().lower(), platform.machine().lower()
    )
    return f"/usr/lib/{arch}-linux-gnu/openblas-pthread/libblas.so.3"


def bundled_reference_blas() -> list[str]:
    """The reference BLAS files the ``mlx[cpu]`` wheel carries (empty when it carries none)."""
    spec = find_spec("mlx")  # locates the package without importing (loading) it
    if spec is None or not spec.submodule_search_locations:
        return []
    found: list[str] = []
    for location in spec.submodule_search_locations:
        site = os.path.dirname(os.path.abspath(location))
        found += sorted(glob.glob(os.path.join(site, "mlx_cpu.libs", "libblas-*.so*")))
    return found


def switch_value(environ: Mapping[str, str]) -> str:
    value = environ.get(SWITCH, "auto").strip().lower() or "auto"
    if value not in SWITCH_VALUES:
        raise DctmsError(
            f"{SWITCH}={environ.get(SWITCH)!r} is not understood: use 'auto' (preload OpenBLAS "
            "when MLX carries the reference BLAS) or 'off' (MLX's own BLAS)"
        )
    return value


def preload_decision(
    environ: Mapping[str, str],
    system: str,
    reference_blas: Sequence[str],
    openblas: str,
    openblas_exists: bool,
) -> str | None:
    """The ``LD_PRELOAD`` value to re-execute with, or None to run as is (a pure function)."""
    if system != "Linux" or switch_value(environ) == "off" or environ.get(REEXEC_MARK):
        return None
    if not reference_blas or not openblas_exists:
        return None
    current = [p for p in environ.get("LD_PRELOAD", "").replace(" ", ":").split(":") if p]
    if any("blas" in os.path.basename(p).lower() for p in current):
        return None  # a BLAS is preloaded already (ours or the user's choice): keep it
    return ":".join([*current, openblas])


def planned_preload() -> str | None:
    """:func:`preload_decision` for this process and machine."""
    openblas = openblas_path()
    return preload_decision(
        os.environ, platform.system(), bundled_reference_blas(), openblas, os.path.isfile(openblas)
    )


def reexec_with_fast_blas(argv: Sequence[str] | None = None) -> None:
    """Replace this process with itself plus OpenBLAS preloaded, when :func:`planned_preload`
    says so; returns only when no re-execution is needed (or possible).

    ``argv`` is the interpreter's full command line (default ``sys.orig_argv``). A process whose
    program came from stdin cannot be started again and is left alone."""
    argv = list(sys.orig_argv if argv is None else argv)
    if not argv or sys.argv[:1] == ["-"]:
        return
    preload = planned_preload()
    if preload is None:
        return
    env = dict(os.environ, LD_PRELOAD=preload, **{REEXEC_MARK: "1"})
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    try:
        os.execve(sys.executable, argv, env)
    except OSError:
        return  # could not re-execute: run on with MLX's own BLAS (reported as such)


@dataclass(frozen=True)
class BlasInfo:
    kind: str  # "openblas" | "reference" | "accelerate" | "other" | "none"
    library: str  # the file that provides cblas_sgemm ("" when none was found)
    detail: str  # e.g. OpenBLAS's build configuration and thread count

    def describe(self) -> str:
        name = {
            "openblas": "OpenBLAS",
            "reference": "reference BLAS (netlib, bundled with mlx[cpu])",
            "accelerate": "Apple Accelerate",
            "other": "BLAS",
            "none": "no BLAS library found",
        }[self.kind]
        parts = [p for p in (self.detail, self.library) if p]
        return f"{name} ({'; '.join(parts)})" if parts else name

    def to_dict(self) -> dict:
        return {"kind": self.kind, "library": self.library, "detail": self.detail}


class _DlInfo(ctypes.Structure):
    _fields_ = [
        ("dli_fname", ctypes.c_char_p),
        ("dli_fbase", ctypes.c_void_p),
        ("dli_sname", ctypes.c_char_p),
        ("dli_saddr", ctypes.c_void_p),
    ]


def _global_provider(symbol: str) -> str | None:
    """The file that defines ``symbol`` in the global scope (what a library loaded later binds)."""
    try:
        address = ctypes.cast(getattr(ctypes.CDLL(None), symbol), ctypes.c_void_p).value
        libc = ctypes.CDLL(ctypes.util.find_library("c") or None)
        dladdr = libc.dladdr
    except (AttributeError, OSError):
        return None
    dladdr.argtypes = [ctypes.c_void_p, ctypes.POINTER(_DlInfo)]
    info = _DlInfo()
    if not dladdr(address, ctypes.byref(info)) or not info.dli_fname:
        return None
    return os.fsdecode(info.dli_fname)


def mapped_libraries(maps_text: str) -> list[str]:
    """Paths of the shared objects in a ``/proc/PID/maps`` text, in first-mapped order."""
    seen: dict[str, None] = {}
    for line in maps_text.splitlines():
        fields = line.split(None, 5)
        if len(fields) == 6 and fields[5].startswith("/") and ".so" in fields[5]:
            seen.setdefault(fields[5].strip(), None)
    return list(seen)


def classify(library: str) -> str:
    real = os.path.realpath(library).lower()
    if "openblas" in real:
        return "openblas"
    if "mlx_cpu.libs" in real and "libblas" in os.path.basename(real):
        return "reference"
    if "accelerate" in real:
        return "accelerate"
    return "other"


def _openblas_detail(library: str) -> str:
    try:
        lib = ctypes.CDLL(library)
        lib.openblas_get_config.restype = ctypes.c_char_p
        config = lib.openblas_get_config().decode(errors="replace").strip()
        threads = int(lib.openblas_get_num_threads())
    except (AttributeError, OSError):
        return ""
    return f"{config}, {threads} thread{'s' if threads != 1 else ''}"


def loaded_blas() -> BlasInfo:
    """The BLAS this process's MLX calls (call after ``import mlx.core``)."""
    library = _global_provider("cblas_sgemm")
    if library is None:
        try:
            with open("/proc/self/maps", encoding="utf-8", errors="replace") as f:
                maps = mapped_libraries(f.read())
        except OSError:
            maps = []
        blas = [p for p in maps if "blas" in os.path.basename(p).lower()]
        library = blas[0] if blas else None
    if library is None:
        return BlasInfo("none", "", "")
    kind = classify(library)
    detail = _openblas_detail(library) if kind == "openblas" else ""
    return BlasInfo(kind, library, detail)
