"""The documentation builds without a warning, its quickstart runs as written, and it matches the code."""

from __future__ import annotations

import argparse
import ast
import importlib.util
import inspect
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
    lm = namespace["lm"]
    assert "forward" not in vars(lm.model), "the traced model did not get its own forward back"
    assert namespace["lm_loss"] < 3.0, "the GPT-2 of section 1 learned nothing"
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


def markdown_table(markdown: str, header: str) -> list[list[str]]:
    """The rows (stripped cells) of the one table of ``markdown`` whose header row is ``header``."""
    lines = markdown.splitlines()
    starts = [i for i, line in enumerate(lines) if _cells(line) == _cells(header)]
    assert len(starts) == 1, f"{len(starts)} tables headed {header!r}"
    rows = []
    for line in lines[starts[0] + 2 :]:  # past the header and its |---| line
        if not line.startswith("|"):
            break
        rows.append(_cells(line))
    return rows


def _cells(line: str) -> list[str]:
    return [c.strip() for c in re.split(r"(?<!\\)\|", line.strip())[1:-1]] if line.startswith("|") else []


NOT_STATED = object()


_BYTES = {"KiB": 1024, "MiB": 1024**2, "GiB": 1024**3}


def stated_default(cell: str) -> object:
    """The value a default cell starts with: a Python literal in backticks (`None`, `"gpipe"`, `9.0`,
    `None` (= ...)), or a number, of seconds or bytes where it says so (`9 s`, `1`, `1 GiB`);
    `NOT_STATED` otherwise."""
    if m := re.match(r"`([^`]+)`", cell):
        try:
            return ast.literal_eval(m.group(1))
        except (ValueError, SyntaxError):
            return NOT_STATED
    if m := re.fullmatch(r"(\d+(?:\.\d+)?)(?:\s*(s|seconds|KiB|MiB|GiB))?(?:\s*\(.*\))?", cell):
        number = float(m.group(1)) if "." in m.group(1) else int(m.group(1))
        return number * _BYTES.get(m.group(2) or "", 1)
    return NOT_STATED


def same_default(stated: object, real: object) -> bool:
    """``9`` (seconds) states ``9.0``, but ``0`` does not state ``False``, nor ``1`` ``True``."""
    numbers = (int, float)
    if isinstance(stated, numbers) and isinstance(real, numbers) and bool not in (type(stated), type(real)):
        return stated == real
    return type(stated) is type(real) and stated == real


#: Lightning's plumbing, set by the Trainer; the tables name them below, not in a row.
LIGHTNING_PARAMETERS = {"self", "accelerator", "checkpoint_io", "precision_plugin"}


@pytest.mark.parametrize("page", ["README.md", "docs/api/strategy.md"])
def test_strategy_parameter_tables_match_the_signature(page):
    from lightning_remote_mp import RemoteModelParallelStrategy

    with open(os.path.join(ROOT, page), encoding="utf-8") as f:
        rows = markdown_table(f.read(), "| parameter | default | meaning |")
    real = {
        name: p.default
        for name, p in inspect.signature(RemoteModelParallelStrategy.__init__).parameters.items()
        if name not in LIGHTNING_PARAMETERS
    }
    documented = {}
    for row in rows:
        m = re.fullmatch(r"`([a-z_]+)`", row[0])
        assert m, f"{page}: a row names {row[0]!r}, not one `parameter`"
        assert m.group(1) not in documented, f"{page}: `{m.group(1)}` has two rows"
        documented[m.group(1)] = row[1]
    assert not (missing := sorted(real.keys() - documented.keys())), f"{page}: no row for {missing}"
    assert not (unknown := sorted(documented.keys() - real.keys())), f"{page}: no such parameter {unknown}"
    for name, cell in documented.items():
        stated = stated_default(cell)
        assert stated is not NOT_STATED, (
            f"{page}: `{name}`'s default {cell!r} does not start with its value, as `None` (= what it means) "
            "or a number (of seconds) does"
        )
        assert same_default(stated, real[name]), (
            f"{page}: `{name}`'s default is {real[name]!r}, the table says {cell!r}"
        )


def test_worker_flags_table_matches_the_parser():
    from lightning_remote_mp.worker import cli

    rows = markdown_table(read("worker.md"), "| flag | default | meaning |")
    options = {a.option_strings[-1]: a for a in cli.build_parser()._actions if "--help" not in a.option_strings}
    effective = {"--bind": cli.DEFAULT_BIND}  # None there means "not given": --bind and --connect exclude each other
    documented = {}
    for row in rows:
        m = re.fullmatch(r"`(--[a-z-]+)(?: [A-Za-z_=:]+)?`", row[0])
        assert m, f"docs/worker.md: a row names {row[0]!r}, not one `--flag [VALUE]`"
        documented[m.group(1)] = row[1]
    assert not (missing := sorted(options.keys() - documented.keys())), f"docs/worker.md: no row for {missing}"
    assert not (unknown := sorted(documented.keys() - options.keys())), f"docs/worker.md: no such flag {unknown}"
    for flag, cell in documented.items():
        action = options[flag]
        real = effective.get(flag, action.default)
        if real is argparse.SUPPRESS:  # --version: no value
            assert cell == "", f"docs/worker.md: {flag} takes no value, the table gives it a default {cell!r}"
        elif isinstance(action, argparse._StoreTrueAction):
            assert cell == "off", f"docs/worker.md: {flag} is off unless given, the table says {cell!r}"
        elif m := re.match(r"`([^`]+)`", cell):  # as one would type it: `16GiB`, `cpu`, `20`
            stated = (action.type or str)(m.group(1))
            assert stated == real, f"docs/worker.md: {flag}'s default is {real!r}, the table says {cell!r}"
        else:  # words for what leaving it out means (this machine's hostname, none), where nothing is given
            assert real in (None, []), f"docs/worker.md: {flag}'s default is {real!r}: state it as `{real}`"


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
