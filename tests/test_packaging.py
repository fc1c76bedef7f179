"""What the package declares about itself: one version, shipped type hints, a true minimum torch."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap

import pytest

import lightning_remote_mp

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
tomllib = pytest.importorskip("tomllib", reason="reading pyproject.toml needs Python 3.11's tomllib")


def pyproject() -> dict:
    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        return tomllib.load(f)


def test_the_version_is_written_once_and_read_without_torch():
    project = pyproject()
    assert "version" not in project["project"] and "version" in project["project"]["dynamic"]
    attr = project["tool"]["setuptools"]["dynamic"]["version"]["attr"]
    assert attr == "lightning_remote_mp._version.__version__"
    # setuptools must read it statically: importing the package would import torch, which a build
    # environment does not have.
    source = f"""
        import sys
        sys.modules["torch"] = None  # any import of torch now fails
        from setuptools.config.expand import read_attr
        print(read_attr({attr!r}, root_dir={ROOT!r}))
    """
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(source)], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == lightning_remote_mp.__version__


def test_type_hints_ship_with_the_package():
    assert os.path.isfile(os.path.join(os.path.dirname(lightning_remote_mp.__file__), "py.typed"))
    assert "py.typed" in pyproject()["tool"]["setuptools"]["package-data"]["lightning_remote_mp"]


def test_the_readme_states_the_minimum_torch_that_pyproject_requires():
    torch_requirement = [d for d in pyproject()["project"]["dependencies"] if re.match(r"torch\b", d)]
    assert torch_requirement == ["torch>=2.5"]
    with open(os.path.join(ROOT, "README.md"), encoding="utf-8") as f:
        assert "lrmp needs torch 2.5 or later" in " ".join(f.read().split())
