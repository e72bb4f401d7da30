"""The wheel's package list (pyproject.toml) names every package of the source tree: an editable install finds a
subpackage that the list forgot, a regular install silently leaves it out."""
from __future__ import annotations

from pathlib import Path

import pytest

tomllib = pytest.importorskip("tomllib")  # Python 3.11+

ROOT = Path(__file__).resolve().parents[1]


def test_every_package_is_listed():
    cfg = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    listed = set(cfg["packages"])
    found = {".".join((name, *init.parent.relative_to(ROOT / folder).parts))
             for name, folder in cfg["package-dir"].items() for init in (ROOT / folder).rglob("__init__.py")}
    assert found - listed == set(), f"packages missing from pyproject.toml: {sorted(found - listed)}"
    assert listed - found == set(), f"listed packages with no __init__.py: {sorted(listed - found)}"
