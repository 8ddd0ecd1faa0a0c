"""A Griffe extension (mkdocs.yml loads it for mkdocstrings): the ``dctms`` subpackages where
pyproject's ``package-dir`` puts them.

Griffe reads a package from its folder, and ``dctms``'s folder (``dctms_pkg/``) holds only
``__init__.py``: ``dctms.schema`` is ``schema/``, ``dctms.toolkit`` is ``toolkit/`` and so on. Without
this, every name ``dctms`` re-exports from a subpackage (``DctmsError``, ``PlanError``) is an alias
Griffe cannot resolve, and mkdocstrings leaves it out of the API page without a warning. The
extension loads each mapped folder and hangs it under ``dctms``; it also adds the names ``dctms``
gives lazily at run time through its module ``__getattr__`` (``CheckResult``), which no static
reading can see.
"""

from __future__ import annotations

import tomllib
from pathlib import Path
from typing import Any

import griffe

ROOT = Path(__file__).resolve().parents[1]

# dctms.__getattr__'s lazy names (kept lazy so that `import dctms` imports nothing).
LAZY = {"CheckResult": "dctms.toolkit.check.CheckResult"}


class PackageDir(griffe.Extension):
    def on_package(self, *, pkg: griffe.Module, loader: griffe.GriffeLoader, **kwargs: Any) -> None:
        if pkg.name != "dctms":
            return
        mapping = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
        for dotted, folder in sorted(mapping["package-dir"].items()):
            parts = dotted.split(".")
            if len(parts) != 2 or parts[1] in pkg.members:
                continue
            # loaded as the top-level module named after its folder, then moved under dctms
            # (an object's path follows its parent, so its members become dctms.<name>.*)
            module = loader.load(ROOT / folder, try_relative_path=False)
            loader.modules_collection.del_member(module.name)
            pkg.set_member(parts[1], module)
        for name, target in LAZY.items():
            pkg.set_member(name, griffe.Alias(name, target, parent=pkg))
