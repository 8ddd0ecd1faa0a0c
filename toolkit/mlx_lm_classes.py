"""mlx-lm's model classes without mlx-lm's package ``__init__``: a compile does not pay for transformers.

``import mlx_lm.models.qwen2`` runs ``mlx_lm/__init__.py`` first, which imports ``convert``,
``generate`` and ``utils``, and with them transformers and huggingface_hub: about 1 s of a compile's
start on a 2-core machine, for code the compiler never calls (tokenizers, loading, conversion).
The compiler needs only ``mlx_lm.models.*`` (model code and caches, which import nothing of the
package above them) and ``mlx_lm.utils._get_classes`` (which model module a config names).

So :func:`defer_package_init` registers the ``mlx_lm`` package with its ``__init__`` not yet run;
the first attribute the package itself is asked for (``mlx_lm.load``, ``mlx_lm.generate``, ...)
runs it then, in the same module object, so any later user of mlx-lm sees the whole package.
Submodule imports (``mlx_lm.models.cache``) need only the package's path and never trigger it.
:func:`model_classes` is ``_get_classes`` with its remapping tables copied
(``tests/test_mlx_lm_classes.py`` checks they are mlx-lm's, for every family it ships).
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
import threading
from types import ModuleType

# mlx_lm.utils (mlx-lm 0.32): model_type -> the module that implements it
MODEL_REMAPPING = {
    "mistral": "llama",
    "llava": "mistral3",
    "phi-msft": "phixtral",
    "falcon_mamba": "mamba",
    "joyai_llm_flash": "deepseek_v3",
    "kimi_k2": "deepseek_v3",
    "qwen2_5_vl": "qwen2_vl",
    "minimax_m2": "minimax",
    "iquestcoder": "llama",
    "xverse": "llama",
    "gemma4_unified": "gemma4",
    "deepseek_v41_text": "deepseek_v41",
}
MODEL_ARCHITECTURE_REMAPPING = {
    ("bailing_hybrid", "BailingMoeV3ForCausalLM"): "bailing_moe_v3",
}

_lock = threading.RLock()


def defer_package_init() -> None:
    """Register ``mlx_lm`` with its ``__init__`` deferred to the first attribute asked of it (a
    no-op when mlx-lm is imported already or not installed)."""
    with _lock:
        if "mlx_lm" in sys.modules:
            return
        spec = importlib.util.find_spec("mlx_lm")
        if spec is None or spec.loader is None or not spec.submodule_search_locations:
            return
        module = importlib.util.module_from_spec(spec)

        def complete(name: str):
            # PEP 562: called only for names the module does not have yet.
            with _lock:
                if module.__dict__.pop("__getattr__", None) is not None:
                    spec.loader.exec_module(module)
            try:
                return module.__dict__[name]
            except KeyError:
                raise AttributeError(f"module 'mlx_lm' has no attribute {name!r}") from None

        module.__getattr__ = complete  # type: ignore[attr-defined]
        sys.modules["mlx_lm"] = module


def model_classes(config: dict) -> tuple[type, type]:
    """mlx-lm's (Model, ModelArgs) for ``config``, as ``mlx_lm.utils._get_classes`` picks them;
    ValueError (its message) when mlx-lm has no such model type."""
    defer_package_init()
    model_type = config["model_type"]
    architectures = config.get("architectures") or ()
    if isinstance(architectures, str):
        architectures = (architectures,)
    for architecture in architectures:
        remapped = MODEL_ARCHITECTURE_REMAPPING.get((model_type, architecture))
        if remapped is not None:
            model_type = remapped
            break
    else:
        model_type = MODEL_REMAPPING.get(model_type, model_type)
    try:
        arch: ModuleType = importlib.import_module(f"mlx_lm.models.{model_type}")
    except ImportError as e:
        raise ValueError(f"Model type {model_type} not supported.") from e
    return arch.Model, arch.ModelArgs


def mlx_lm_version() -> str:
    """mlx-lm's version, read without running its package ``__init__``."""
    defer_package_init()
    from mlx_lm._version import __version__

    return __version__
