"""Shared fixtures: a small valid plan built by hand (until the compiler produces real ones).

The tiny plan has one "decode" phase of 6 ops over 5 slots:

    slot 0: op0 Gather(w_emb, tok)              -> t0  [1,1,8] f16  (memory-bound)
    slot 1: op1 Reshape(t0)                     -> t1  view of t0
            op3 DynamicSliceUpdate(k_in, t0, pos) -> k_out, kind "state" (the KV cache)
    slot 2: op2 Multiply(t1, c_half)            -> t2  [1,8] f16    (memory-bound)
    slot 3: op4 Maximum(t2, c_floor)            -> t3  [1,8] f16
    slot 4: op5 ArgMax(t3)                      -> out [1] u32, kind "output"; sync point

Arena tenants t0 [0,2], t2 [2,3], t3 [3,4], out [4,4] (alignment 64): buffer 0 = {t0, t3}, buffer 1 =
{t2, out}; offsets t0=0, t2=64, t3=0, out=64; arena 128 = lower bound 128.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import msgspec
import pytest
from filelock import FileLock

from dctms.schema.fingerprint import layout_sha256
from dctms.schema.io import encode_plan, write_plan
from dctms.schema.types import (
    SCHEMA_VERSION,
    Binding,
    Bounds,
    Buffer,
    Constant,
    Envelope,
    Generator,
    Intermediate,
    KVStorage,
    ModelInfo,
    ModuleRuns,
    ModuleTree,
    Op,
    Output,
    Phase,
    Plan,
    Scratch,
    StateTensor,
    StateView,
    Stats,
    SyncPoint,
    Target,
    TargetProfile,
    Weights,
    WeightTensor,
)

SHA = "0" * 63 + "1"


def pytest_configure(config: pytest.Config) -> None:
    """The suite runs on the BLAS the ``dctms`` commands use: a ``pytest`` started without
    OpenBLAS preloaded re-executes itself once with it (dctms.runner.blas; DCTMS_BLAS=off keeps
    MLX's own). Only a pytest started from the command line: a host program calling
    ``pytest.main`` is left as it is."""
    from dctms.runner.blas import planned_preload, reexec_with_fast_blas

    if config.pluginmanager.hasplugin("xdist") and config.getoption("numprocesses", None):
        # One OpenBLAS thread per process when the workers share the cores: OpenBLAS's threads
        # spin (sched_yield) while they wait for each other, so two workers each with a thread
        # per core oversubscribe them. tests/test_real_model.py with tests/test_sampling.py on 2
        # workers: 53 s with 2 threads, 46 and 47 s with 1 (2026-12-03, the 2-core machine).
        # Workers and every subprocess inherit it; a value the caller set is kept.
        os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
    _share_a_packing_cache()
    program = os.path.basename(sys.argv[0]) if sys.argv else ""
    if program not in ("pytest", "py.test", "__main__.py") or planned_preload() is None:
        return
    capture = config.pluginmanager.getplugin("capturemanager")
    if capture is not None:
        capture.stop_global_capturing()  # the new process must write to the real stdout/stderr
    reexec_with_fast_blas()


_PACK_CACHE_OWNER = "DCTMS_TEST_PACK_CACHE_OWNER"


def _share_a_packing_cache() -> None:
    """One packing cache (toolkit.pack.memo) for the run: its workers and every ``dctms`` they
    start share it, and it starts empty (never the user's ~/.cache). The same compiles recur across
    modules and processes, so each distinct phase is packed once a run (47 of the 172 CPU seconds
    the suite spent packing went to repeats, 2026-12-03). A folder the caller set is kept."""
    if os.environ.get("DCTMS_PACK_CACHE") is None:
        import tempfile

        os.environ["DCTMS_PACK_CACHE"] = tempfile.mkdtemp(prefix="dctms-test-packings-")
        os.environ[_PACK_CACHE_OWNER] = str(os.getpid())  # the same pid after the BLAS re-exec


def pytest_unconfigure(config: pytest.Config) -> None:
    if os.environ.get(_PACK_CACHE_OWNER) == str(os.getpid()):
        shutil.rmtree(os.environ["DCTMS_PACK_CACHE"], ignore_errors=True)


# ------------------------------------------------------------------- parallel runs (pytest-xdist)
# `make test` runs the suite on several workers (`-n auto --dist loadgroup`). Each test module is
# one unit of work, so its module-scoped fixtures are built once and its tests, which may share
# files, never run at the same time. A module or test marked `spread` leaves its tests free to run
# on different workers at once (they share nothing but the on-disk `shared_cache`). Units start
# heaviest first, weighed by their `slow` tests, so no long module is left for the end.
SLOW_WEIGHT = 20  # a slow test costs about as much as this many quick ones


@pytest.hookimpl(tryfirst=True)  # before xdist's own, which reads the groups into the ids
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if not os.environ.get("PYTEST_XDIST_WORKER"):
        return
    unit: dict[str, str] = {}
    weight: dict[str, int] = {}
    for item in items:
        if item.get_closest_marker("xdist_group") is None and not item.get_closest_marker("spread"):
            item.add_marker(pytest.mark.xdist_group(item.path.name))
        groups = [
            m.args[0] if m.args else m.kwargs["name"] for m in item.iter_markers("xdist_group")
        ]
        unit[item.nodeid] = groups[0] if groups else item.nodeid
        cost = SLOW_WEIGHT if item.get_closest_marker("slow") else 1
        weight[unit[item.nodeid]] = weight.get(unit[item.nodeid], 0) + cost
    # Stable: equal weights keep the collection order (every worker must collect the same order).
    items.sort(key=lambda item: -weight[unit[item.nodeid]])


def _shared_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A folder all workers of this run share: the run's base temporary folder (a worker's own
    is a sub-folder of it), or this session's own when not run by xdist."""
    base = tmp_path_factory.getbasetemp()
    return base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base


@pytest.fixture(scope="session")
def shared_cache(tmp_path_factory) -> Callable[[str, Callable[[Path], None]], Path]:
    """``shared_cache(key, make)``: the folder ``make(folder)`` filled, made once per run for each
    key (e.g. a digest of a compile's inputs) and shared by every worker: the first to ask makes
    it under a file lock, the others wait for it and read it. Never write to it."""
    root = _shared_root(tmp_path_factory) / "shared-cache"
    root.mkdir(exist_ok=True)

    def cached(key: str, make: Callable[[Path], None]) -> Path:
        folder = root / key
        with FileLock(str(root / f"{key}.lock")):
            if not (folder / ".done").exists():
                shutil.rmtree(folder, ignore_errors=True)  # a maker that failed half-way
                folder.mkdir()
                make(folder)
                (folder / ".done").touch()
        return folder

    return cached


# A two-layer random-weight qwen2 config the runner tests build models from (toolkit.tiny_model).
TINY_QWEN2 = {
    "model_type": "qwen2",
    "hidden_size": 64,
    "num_hidden_layers": 2,
    "intermediate_size": 128,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 257,
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0,
    "tie_word_embeddings": True,
    "torch_dtype": "float32",
    "eos_token_id": 256,
}


def make_tiny_plan() -> Plan:
    kv_shape = [1, 16, 8]
    emb = WeightTensor("model.embed_tokens.weight", [16, 8], "float16", 256)
    keys = StateTensor("layers.0.keys", "kv", kv_shape, "float16", 256)
    phase = Phase(
        name="decode",
        tokens=1,
        inputs=[
            Binding("tok", "input", "tokens", [1, 1], "int32"),
            Binding("pos", "input", "position", [1], "int32"),
            Binding("w_emb", "weight", emb.name, emb.shape, emb.dtype),
            Binding("k_in", "state", keys.name, kv_shape, "float16"),
        ],
        outputs=[
            Binding("out", "output", "next_token", [1], "uint32"),
            Binding("k_out", "state", keys.name, kv_shape, "float16"),
        ],
        constants=[
            Constant("c_half", [], "float16", [0.5]),
            Constant("c_floor", [1], "float16", [-math.inf]),
        ],
        ops=[
            Op("Gather", ["w_emb", "tok"], ["t0"], args=[[0], [1, 8]], memory_bound=True),
            Op("Reshape", ["t0"], ["t1"], args=[[1, 8]]),
            Op("Multiply", ["t1", "c_half"], ["t2"], memory_bound=True),
            Op("DynamicSliceUpdate", ["k_in", "t0", "pos"], ["k_out"], args=[[1]], scratch=8),
            Op("Maximum", ["t2", "c_floor"], ["t3"]),
            Op("ArgMax", ["t3"], ["out"], args=[1, False]),
        ],
        tensors=[
            Intermediate("t0", [1, 1, 8], "float16", 16, [0, 2], buffer=0, offset=0),
            Intermediate("t1", [1, 8], "float16", 16, [1, 2], view_of="t0"),
            Intermediate("t2", [1, 8], "float16", 16, [2, 3], buffer=1, offset=64),
            StateView("k_out", kv_shape, "float16", 256, [1, 1], view_of="k_in"),
            Scratch("scratch.3", [8], "uint8", 8, [1, 1], buffer=1, offset=64, op=3),
            Intermediate("t3", [1, 8], "float16", 16, [3, 4], buffer=0, offset=0),
            Output("out", [1], "uint32", 4, [4, 4], buffer=1, offset=64),
        ],
        buffers=[Buffer(0, 16), Buffer(1, 16)],
        slots=[[0], [1, 3], [2], [4], [5]],
        sync_points=[SyncPoint(4, "sample next token", evaluate=["k_out", "out"])],
        arena_bytes=128,
        lower_bound_bytes=128,
        arena_optimal="lower_bound",
        # ops 0-1 in model.embed_tokens, 2-4 in model.layers.0.self_attn, 5 in (step)
        modules=ModuleRuns(lengths=[2, 3, 1], modules=[2, 5, 0]),
    )
    return Plan(
        schema_version=SCHEMA_VERSION,
        generator=Generator("0.1.0", "0.32.0", "0.32.0"),
        bounds=Bounds(8, 8, 1, 4, "float16", KVStorage("float16"), kv_capacity=16),
        model=ModelInfo(
            architecture="tiny",
            config_sha256=SHA,
            num_layers=1,
            vocab_size=16,
            weights=Weights(
                count=1,
                total_bytes=256,
                layout_sha256=layout_sha256([(emb.name, emb.shape, emb.dtype)]),
                tensors=[emb],
            ),
        ),
        target=Target(
            backend="cpu",
            alignment=64,
            profile=TargetProfile("test", 1e12, "made up", 1e11, "made up"),
            device_memory=2**20,
        ),
        state=[keys],
        phases=[phase],
        envelope=Envelope(
            weights=256,
            kv=256,
            persistent=0,
            intermediate=128,
            runtime=1024,
            total=1664,
            runtime_source="test allowance",
            device=2**20,
            free=2**20 - 1664,
        ),
        stats=Stats(
            logical_tensors=5,
            physical_buffers=2,
            reduction=0.6,
            arena_bytes=128,
            lower_bound_bytes=128,
        ),
        modules=ModuleTree(
            parents=[-1, -1, 1, 1, 3, 4],
            names=["(step)", "model", "embed_tokens", "layers", "0", "self_attn"],
        ),
    )


def make_broken_tiny_plan() -> Plan:
    """The tiny plan with tensor t2 moved onto t0's bytes while both are live (the verifier's
    ``arena_overlap`` rule refuses it; written by ``write_plan``, its digest matches)."""
    plan = make_tiny_plan()
    phase = plan.phases[0]
    tensors = [msgspec.structs.replace(t, offset=0) if t.id == "t2" else t for t in phase.tensors]
    return msgspec.structs.replace(plan, phases=[msgspec.structs.replace(phase, tensors=tensors)])


@pytest.fixture
def tiny_plan() -> Plan:
    return make_tiny_plan()


@pytest.fixture(scope="session")
def tiny_plan_bytes() -> bytes:
    """Canonical bytes of the tiny plan (immutable, so safe to share with hypothesis tests)."""
    return encode_plan(make_tiny_plan())


@pytest.fixture
def plan_file(tmp_path: Path, tiny_plan: Plan) -> Path:
    """The tiny plan written to ``tmp_path/tiny.plan``."""
    path = tmp_path / "tiny.plan"
    write_plan(tiny_plan, path)
    return path


# Runs the compile as its child, so its RUSAGE_CHILDREN is that one compile's peak RSS.
_MEASURED = (
    "import resource, subprocess, sys; "
    "proc = subprocess.run(sys.argv[2:]); "
    "open(sys.argv[1], 'w').write(str(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)); "
    "sys.exit(proc.returncode)"
)


@pytest.fixture(scope="session")
def cli_compile(shared_cache):
    """``dctms compile CONFIG ARGS... -o PLAN`` in a fresh process, run once per run for each
    distinct (config bytes, arguments) and shared by every test and worker that asks for the same
    compile (the checked-in 7B plan takes seconds). Returns (the finished process, the plan's
    path, the compile process's peak RSS in KiB); never write to the plan."""

    def compiled(config: Path, *args: str) -> tuple[subprocess.CompletedProcess, Path, int]:
        key = hashlib.sha256(config.read_bytes() + b"\0" + "\0".join(args).encode()).hexdigest()
        argv = [sys.executable, "-m", "dctms.cli.main", "compile", str(config), *args]

        def make(folder: Path) -> None:
            out, peak = folder / "compiled.plan", folder / "peak_kib"
            measured = [sys.executable, "-c", _MEASURED, str(peak), *argv, "-o", str(out)]
            proc = subprocess.run(measured, capture_output=True, text=True, check=False)
            record = {"returncode": proc.returncode, "stdout": proc.stdout, "stderr": proc.stderr}
            (folder / "process.json").write_text(json.dumps(record))

        folder = shared_cache(f"cli-compile-{key[:32]}", make)
        record = json.loads((folder / "process.json").read_text())
        proc = subprocess.CompletedProcess(argv, record["returncode"], record["stdout"],
                                           record["stderr"])  # fmt: skip
        peak = folder / "peak_kib"
        return proc, folder / "compiled.plan", int(peak.read_text()) if peak.exists() else 0

    return compiled
