"""lrmp's messages show like Lightning's own: with no logging set-up, once, and quieted the same way.

Each case runs in a fresh interpreter: under pytest the root logger always has handlers, and
whether it had them when Lightning was imported is exactly what is being tested. Importing
Lightning costs each interpreter seconds of CPU, so the three start together (`programs`) and
each test reads its own; each skips the interpreter's slow teardown of torch and Lightning
(`EXIT`: another second or two each) once its logs are flushed.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
from collections.abc import Callable, Iterator

import pytest

pytestmark = pytest.mark.timeout(120)

EXIT = """
    import logging, os, sys

    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
"""


def start_python(source: str, *args: str) -> subprocess.Popen:
    program = textwrap.dedent(source) + textwrap.dedent(EXIT)
    return subprocess.Popen(
        [sys.executable, "-c", program, *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )


def finish(proc: subprocess.Popen) -> subprocess.CompletedProcess:
    out, err = proc.communicate(timeout=110)
    assert proc.returncode == 0, out + err
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


FIT = """
    import sys

    import lightning as L
    import torch
    from torch.utils.data import DataLoader, TensorDataset

    from lightning_remote_mp import RemoteModelParallelStrategy, SpecSequential

    torch.set_num_threads(1)
    SPEC = [
        ("torch.nn.Linear", {"in_features": 2, "out_features": 8}, (4, 2)),
        ("torch.nn.ReLU", {}, (4, 8)),
        ("torch.nn.Linear", {"in_features": 8, "out_features": 1}, (4, 8)),
    ]

    class Model(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = SpecSequential(SPEC)

        def training_step(self, batch, batch_idx):
            return self.net(batch[0]).pow(2).mean()

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    loader = DataLoader(TensorDataset(torch.randn(8, 2)), batch_size=4)
    strategy = RemoteModelParallelStrategy(hosts=sys.argv[1:3], balance=[2, 1])
    trainer = L.Trainer(
        strategy=strategy, max_epochs=1, logger=False, enable_checkpointing=False, enable_progress_bar=False
    )
    trainer.fit(Model(), loader)
"""

# What shows, level by level; run after the set-up under test.
LEVELS = """
    import logging

    log = logging.getLogger("lightning_remote_mp.driver.session")
    log.info("shown: info by default")
    log.warning("shown: a warning")
    log.debug("hidden: debug by default")
    logging.getLogger("lightning.pytorch").setLevel(logging.WARNING)
    log.info("hidden: lightning.pytorch at WARNING")
    logging.getLogger("lightning_remote_mp").setLevel(logging.INFO)
    log.info("shown: its own level beats Lightning's")
    logging.getLogger("lightning_remote_mp").setLevel(logging.WARNING)
    log.info("hidden: lightning_remote_mp at WARNING")
"""


def shown(stderr: str, prefix: str = "") -> None:
    lines = [line for line in stderr.splitlines() if "shown:" in line or "hidden:" in line]
    expected = ["shown: info by default", "shown: a warning", "shown: its own level beats Lightning's"]
    assert lines == [prefix + line for line in expected], stderr


BASIC_CONFIG = """
    import logging
    import sys

    if sys.argv[1] == "before":
        logging.basicConfig(format="ROOT %(message)s")
    import lightning.pytorch  # noqa: F401
    import lightning_remote_mp  # noqa: F401  (with Lightning imported: registers the strategy, sets up logging)

    if sys.argv[1] == "after":
        logging.basicConfig(format="ROOT %(message)s")
"""


@pytest.fixture(scope="module")
def programs(_worker_pool) -> Iterator[Callable[[str], subprocess.CompletedProcess]]:
    """Starts every case's interpreter at once; ``programs(name)`` waits for that one's end."""
    pool = _worker_pool.addresses
    procs = {
        "fit": start_python(FIT + LEVELS, *pool[:2]),
        "before": start_python(BASIC_CONFIG + LEVELS, "before"),
        "after": start_python(BASIC_CONFIG + LEVELS, "after"),
    }
    yield lambda name: finish(procs[name])
    for proc in procs.values():
        if proc.poll() is None:
            proc.kill()
        proc.communicate()


def test_the_placement_shows_on_stderr_once_without_any_logging_set_up(programs, pool):
    err = programs("fit").stderr
    assert err.count("SpecSequential 'net' placed:") == 1, err
    assert err.count(f"stage 0 @ {pool[0]}: layers 0-1 (Linear, ReLU)") == 1, err
    assert err.count(f"stage 1 @ {pool[1]}: layers 2-2 (Linear)") == 1, err
    shown(err)


@pytest.mark.parametrize("when", ["before", "after"])
def test_with_basic_config_each_line_shows_once_in_its_format(programs, when):
    """Before importing Lightning or after: either way once (Lightning's own lines show twice
    when basicConfig comes first), and quieted as without it."""
    shown(programs(when).stderr, prefix="ROOT ")
