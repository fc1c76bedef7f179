"""The documentation builds without a warning, its quickstart runs as written, and it matches the code."""

from __future__ import annotations

import importlib.util
import logging
import os
import re
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DOCS = os.path.join(ROOT, "docs")


def read(page: str) -> str:
    with open(os.path.join(DOCS, page), encoding="utf-8") as f:
        return f.read()


def python_blocks(markdown: str) -> list[str]:
    """The fenced ```python blocks of a page, in order (indented ones included, dedented)."""
    blocks = []
    for m in re.finditer(r"^([ \t]*)```python[ \t]*\n(.*?)^\1```[ \t]*$", markdown, re.S | re.M):
        indent, body = m.group(1), m.group(2)
        blocks.append(
            "".join(line[len(indent) :] if line.startswith(indent) else line for line in body.splitlines(True))
        )
    return blocks


@pytest.mark.timeout(180)
def test_mkdocs_build_strict(tmp_path):
    missing = [m for m in ("mkdocs", "material", "mkdocstrings", "mkdocstrings_handlers.python") if not _importable(m)]
    if missing:
        pytest.skip(f"the docs tooling is not installed ({', '.join(missing)}): pip install -e '.[docs]'")
    env = dict(os.environ, NO_MKDOCS_2_WARNING="1")  # mkdocs-material's banner about its successor
    proc = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=170,
    )
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, output
    assert not re.search(r"^(WARNING|ERROR)\b", output, re.M), output
    for page in ("index.html", "quickstart/index.html", "api/strategy/index.html", "troubleshooting/index.html"):
        assert (tmp_path / "site" / page).exists(), page
    # The API page is generated from the strategy's docstring.
    api = (tmp_path / "site" / "api" / "strategy" / "index.html").read_text(encoding="utf-8")
    for parameter in ("hosts", "balance", "local_workers", "curve", "heartbeat_timeout", "connect_timeout"):
        assert parameter in api, parameter


def _importable(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except ModuleNotFoundError:
        return False


@pytest.fixture
def restore_logging():
    logger = logging.getLogger("lightning_remote_mp")
    level, root_handlers = logger.level, list(logging.getLogger().handlers)
    yield
    logger.setLevel(level)
    logging.getLogger().handlers[:] = root_handlers


@pytest.mark.timeout(180)
def test_quickstart_runs_as_written(tmp_path, monkeypatch, restore_logging):
    page = read("quickstart.md")
    blocks = python_blocks(page)
    assert len(blocks) >= 4
    source = "\n".join(blocks)
    assert "tcp://" not in source and "hosts=" not in source, "the executed blocks must use local workers only"
    monkeypatch.chdir(tmp_path)  # whatever the blocks write lands here
    namespace: dict = {"__name__": "quickstart"}
    for i, block in enumerate(blocks):
        exec(compile(block, f"docs/quickstart.md (python block {i + 1})", "exec"), namespace)
    # What the page says happened, happened: trained remotely, local again afterwards.
    model, trainer = namespace["model"], namespace["trainer"]
    assert type(trainer.strategy).__name__ == "RemoteModelParallelStrategy" and trainer.strategy.hosts is None
    assert trainer.strategy.session is None and not model.net.is_remote
    assert namespace["accuracy"] > 0.8


def test_worker_page_documents_every_flag():
    from lightning_remote_mp.worker.cli import build_parser

    page = read("worker.md")
    flat = " ".join(page.split())
    options = [a for a in build_parser()._actions if a.option_strings and "--help" not in a.option_strings]
    documented = set(re.findall(r"^\| `(--[a-z-]+)", page, re.M))
    assert documented == {a.option_strings[0] for a in options}
    for action in options:
        # The page's copy of `lrmp-worker --help` still says what the parser says.
        assert " ".join(action.help.split()) in flat, action.option_strings


def test_features_page_lists_every_refused_callback():
    from lightning_remote_mp.lightning.intercept import refused_callbacks

    page = read("features.md")
    refused = page[page.index("## Refused at setup") :]
    for cls, _ in refused_callbacks():
        assert f"`{cls.__name__}`" in refused, cls.__name__
    assert "16-mixed" in refused and "GradScaler" in refused


def test_docs_link_only_to_existing_pages():
    # mkdocs --strict checks this too; this runs even where mkdocs is not installed.
    with open(os.path.join(ROOT, "mkdocs.yml"), encoding="utf-8") as f:
        nav_pages = set(re.findall(r":\s*([\w/]+\.md)\s*$", f.read(), re.M))
    on_disk = {os.path.relpath(os.path.join(d, n), DOCS) for d, _, ns in os.walk(DOCS) for n in ns if n.endswith(".md")}
    assert nav_pages == on_disk
