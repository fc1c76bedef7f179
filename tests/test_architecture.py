"""The shape of the house: the walls between the layers hold, the root stays small, and no module
outgrows one concept. CI also runs ``lint-imports`` on its own (.ci/run)."""

from __future__ import annotations

import os
import shutil
import subprocess

import pytest

import lightning_remote_mp

PACKAGE = os.path.dirname(lightning_remote_mp.__file__)
ROOT = os.path.dirname(PACKAGE)


def _modules() -> list[str]:
    return [
        os.path.join(folder, name)
        for folder, _, names in os.walk(PACKAGE)
        for name in names
        if name.endswith(".py") and "__pycache__" not in folder
    ]


def test_the_walls_between_the_layers_hold():
    lint = shutil.which("lint-imports")
    if lint is None:
        pytest.skip("import-linter is not installed (pip install -e '.[test]')")
    proc = subprocess.run([lint], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]
    assert "0 broken" in proc.stdout


def test_the_root_holds_at_most_eight_modules():
    root = sorted(n for n in os.listdir(PACKAGE) if n.endswith(".py"))
    assert len(root) <= 8, root


def test_no_module_is_over_700_lines():
    sizes = {os.path.relpath(p, ROOT): sum(1 for _ in open(p, encoding="utf-8")) for p in _modules()}
    assert {p: n for p, n in sizes.items() if n > 700} == {}
