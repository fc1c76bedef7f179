"""Fixtures: real lrmp-worker processes on 127.0.0.1 with ports picked at run time.

Every worker a test starts is stopped when the test ends, whatever happens.
"""

from __future__ import annotations

import copy
import logging
import os
import sys
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))  # the workers import lrmp_testlayers from here too

from lightning_remote_mp.driver.launch import LocalWorkers  # noqa: E402
from lightning_remote_mp.worker.deferred_grads import MIN_MACS_ENV  # noqa: E402

torch.set_num_threads(1)
# The tests' models are tiny: with split_backward="auto" (the default) no linear layer of theirs
# would defer its weight gradient on a CPU worker, and every Lightning feature would go untested
# with split backward. Every worker the tests start (they inherit this) defers every call; the
# tests of the threshold itself set the variable as they need. Set it beforehand to run the suite at
# another threshold (the workers' own default: CPU_MIN_MACS).
os.environ.setdefault(MIN_MACS_ENV, "0")
logging.getLogger("lightning.pytorch").setLevel(logging.WARNING)


@pytest.fixture
def start_workers() -> Iterator[Callable[..., LocalWorkers]]:
    """``start_workers(n, allow_modules=[...])`` starts ``n`` real workers; all are stopped at test end."""
    started: list[LocalWorkers] = []

    def start(n: int = 2, allow_modules: tuple[str, ...] = ("lrmp_testlayers",), **kwargs) -> LocalWorkers:
        workers = LocalWorkers(n, devices=["cpu"] * n, threads=1, allow_modules=allow_modules, **kwargs)
        started.append(workers)
        workers.start()
        return workers

    yield start
    for w in started:
        w.stop()


@pytest.fixture
def twin() -> Callable:
    """``twin(module)`` returns an identical deep copy, for remote-versus-local comparisons."""
    return copy.deepcopy


@pytest.fixture(scope="session")
def _worker_pool() -> Iterator[LocalWorkers]:
    workers = LocalWorkers(4, devices=["cpu"] * 4, threads=1, allow_modules=("lrmp_testlayers",))
    workers.start()
    yield workers
    workers.stop()


@pytest.fixture
def pool(_worker_pool: LocalWorkers) -> list[str]:
    """Addresses of four workers shared by the tests that neither kill nor reconfigure workers.

    Starting a worker costs seconds of CPU (torch and its lazy imports); sharing them keeps the
    suite fast. Each run opens a fresh session on them, as a new driver would.
    """
    dead = [i for i in range(4) if _worker_pool.why_dead(i)]
    assert not dead, f"a shared worker died: {[_worker_pool.why_dead(i) for i in dead]}"
    return list(_worker_pool.addresses)


@pytest.fixture
def make_lan() -> Iterator[Callable[..., Any]]:
    """``make_lan(hosts, rate)`` builds an emulated LAN (`lrmp_lan.Lan`: host 0 is this process, the
    others network namespaces, every link shaped to ``rate``); skips the test where namespaces cannot
    be made. Every LAN is torn down when the test ends, whatever happens."""
    from lrmp_lan import Lan, LanUnavailable

    made: list[Lan] = []

    def make(hosts: int = 3, rate: str = "1gbit") -> Lan:
        try:
            lan = Lan(hosts, rate)
        except LanUnavailable as err:
            pytest.skip(f"no emulated LAN here: {err}")
        made.append(lan)
        return lan

    yield make
    for lan in made:
        lan.close()
