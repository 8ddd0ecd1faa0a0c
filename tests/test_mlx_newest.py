"""Issue 33, item 7: the newest MLX minor the package index serves is the one the suite runs on,
or dctms refuses it at start in one line (its export format and allocators are not modelled).

``make setup`` installs the newest release the pinned range allows, so when the index's newest
minor is inside the range this suite runs on that minor; when a newer minor appears, this test says
which, and that a process given it stops in one line naming both. Skipped, saying why, where the
index cannot be reached.
"""

from __future__ import annotations

import importlib.metadata
import re
import subprocess
import sys

import pytest

from dctms.schema.targets import SUPPORTED_MLX, mlx_minor, unsupported_mlx


def _newest_on_the_index() -> str:
    try:
        proc = subprocess.run(
            [sys.executable, "-m", "pip", "index", "versions", "mlx", "--disable-pip-version-check"],
            capture_output=True, text=True, timeout=120,
        )  # fmt: skip
    except subprocess.TimeoutExpired:
        pytest.skip("the package index did not answer within 120 s")
    found = re.search(r"^mlx \(([^)]+)\)", proc.stdout, re.MULTILINE)
    if proc.returncode != 0 or found is None:
        pytest.skip(f"the package index cannot be reached: {proc.stderr.strip()[-200:]}")
    return found.group(1)


@pytest.mark.slow
def test_the_newest_mlx_minor_is_the_one_tested_or_refused_in_one_line() -> None:
    newest = _newest_on_the_index()
    installed = importlib.metadata.version("mlx")
    if mlx_minor(newest) in SUPPORTED_MLX:
        assert unsupported_mlx(newest) is None
        assert mlx_minor(installed) == mlx_minor(newest), (
            f"the index's newest mlx is {newest}, this suite runs on {installed}"
        )
    else:  # a newer minor than dctms models: refused at start, in one line naming both
        why = unsupported_mlx(newest)
        assert why is not None and newest in why and "\n" not in why
        assert all(f"{minor}.x" in why for minor in SUPPORTED_MLX)
