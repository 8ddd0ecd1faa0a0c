"""toolkit.mlx_lm_classes: mlx-lm's model classes as mlx-lm picks them, without its package init."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from dctms.toolkit import mlx_lm_classes

ROOT = Path(__file__).resolve().parents[1]


def test_the_remapping_tables_are_mlx_lms() -> None:
    import mlx_lm.utils

    assert mlx_lm_classes.MODEL_REMAPPING == mlx_lm.utils.MODEL_REMAPPING
    assert mlx_lm_classes.MODEL_ARCHITECTURE_REMAPPING == mlx_lm.utils.MODEL_ARCHITECTURE_REMAPPING


def _configs() -> list[dict]:
    import mlx_lm.models

    folder = Path(mlx_lm.models.__path__[0])
    types = sorted(p.stem for p in folder.glob("*.py") if not p.stem.startswith("_"))
    configs = [{"model_type": t} for t in types]
    configs += [{"model_type": t} for t in mlx_lm_classes.MODEL_REMAPPING]
    configs += [
        {"model_type": t, "architectures": [a]}
        for t, a in mlx_lm_classes.MODEL_ARCHITECTURE_REMAPPING
    ]
    configs += [
        {"model_type": t, "architectures": a}
        for t, a in mlx_lm_classes.MODEL_ARCHITECTURE_REMAPPING
    ]
    return [
        *configs,
        {"model_type": "no_such_family"},
        {"model_type": "llama", "architectures": []},
    ]


def test_model_classes_are_get_classes_for_every_module_mlx_lm_ships() -> None:
    from mlx_lm.utils import _get_classes

    def outcome(fn, config):
        try:
            return fn(config)
        except ValueError as err:
            return f"ValueError: {err}"
        except (Exception, SystemExit) as err:  # noqa: BLE001 - a module that cannot import
            return type(err).__name__  # (olmo without hf_olmo exits) fails the same in both

    configs = _configs()
    assert len(configs) > 50
    for config in configs:
        assert outcome(mlx_lm_classes.model_classes, config) == outcome(_get_classes, config), (
            config
        )
    with pytest.raises(ValueError, match="Model type no_such_family not supported"):
        mlx_lm_classes.model_classes({"model_type": "no_such_family"})


def test_a_compile_imports_no_transformers_and_mlx_lm_stays_whole() -> None:
    """A fresh interpreter compiles a tiny plan without importing transformers; asking mlx-lm's
    package for anything afterwards runs its __init__ then (load, generate, __version__)."""
    code = textwrap.dedent(
        """
        import json, sys, tempfile, pathlib
        from dctms.schema.model_folder import open_model
        from dctms.toolkit.compiler import CompileOptions, compile_plan
        cfg = {"model_type": "qwen2", "hidden_size": 64, "num_hidden_layers": 2,
               "intermediate_size": 128, "num_attention_heads": 4, "num_key_value_heads": 2,
               "vocab_size": 128, "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
               "tie_word_embeddings": True}
        folder = pathlib.Path(tempfile.mkdtemp())
        (folder / "config.json").write_text(json.dumps(cfg))
        plan = compile_plan(open_model(folder), CompileOptions(32, 8))
        assert "transformers" not in sys.modules, "transformers imported"
        assert "mlx_lm.utils" not in sys.modules, "mlx_lm.utils imported"
        import mlx_lm
        from mlx_lm._version import __version__
        assert plan.generator.mlx_lm == __version__ == mlx_lm.__version__
        assert callable(mlx_lm.load) and callable(mlx_lm.generate)
        from mlx_lm import stream_generate
        assert callable(stream_generate) and "transformers" in sys.modules
        print("ok")
        """
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "ok"
