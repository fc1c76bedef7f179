"""Fixtures: real lrmp-worker processes on 127.0.0.1 with ports picked at run time.

Every worker a test starts is stopped when the test ends, whatever happens.
"""

from __future__ import annotations

import copy
import logging
import os
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))  # the workers import lrmp_testlayers from here too

import lrmp_lan  # noqa: E402

from lightning_remote_mp.driver.launch import LocalWorkers, WorkerOutput  # noqa: E402
from lightning_remote_mp.worker.deferred_grads import MIN_MACS_ENV  # noqa: E402

torch.set_num_threads(1)
# The tests' models are tiny: with split_backward="auto" (the default) no linear layer of theirs
# would defer its weight gradient on a CPU worker, and every Lightning feature would go untested
# with split backward. Every worker the tests start (they inherit this) defers every call; the
# tests of the threshold itself set the variable as they need. Set it beforehand to run the suite at
# another threshold (the workers' own default: CPU_MIN_MACS).
os.environ.setdefault(MIN_MACS_ENV, "0")
logging.getLogger("lightning.pytorch").setLevel(logging.WARNING)


#: What the default run (CI's, `python -m pytest`) leaves to the full one (`python -m pytest -m ""`):
#: a second family, schedule or micro-batch count of a test whose first case
#: runs by default, and the benchmarks whose own runs are in benchmarks/README.md. Each feature keeps a
#: case in the default run, which fits in 15 minutes on 2 cores; the full run (49 more cases) about 21.
SLOW = {
    "test_benchmarks.py::test_quick_mode_prints_a_table": (
        "throughput.py",
        "memory.py",
        "tracing.py",
        "lan.py",
        "compression.py",
        "loss_placement.py",
    ),
    "test_examples.py::test_finetune_pretrained_exports_a_model_transformers_loads": ("", "lora"),
    "test_hf_sweep.py::test_a_family_of_each_kind_trains_remotely_as_it_does_locally": (
        "rotary",
        "ALiBi",
        "sliding window",
        "soft-capping",
        "state space",
        "encoder-decoder",
        "classification head",
        "mixture of experts",  # MoE also trains in test_hf_zoo (mixtral, and its default path)
        "learned positions, tied",  # also test_hf_zoo's gpt2
        "attention swapped inside forward",
        "latent cross-attention",
    ),
    "test_hf_zoo.py::test_a_family_fine_tunes_remotely_as_it_does_locally": tuple(
        f"{family}-1" for family in ("gpt2", "llama", "qwen2", "mixtral", "bert", "t5", "vit", "lora_llama")
    )
    + ("t5-4",),  # t5 also trains in test_t5_stages_may_start_anywhere_its_shared_embedding_is_held_by_three
    "test_hf_zoo.py::test_a_family_trains_under_zero_bubble_as_locally": ("t5", "bert"),
    "test_schedules.py::test_the_timeline_shows_each_stage_running_its_list": ("gpipe", "zero_bubble"),
    # a bound: the refusal without a checkpoint stays in the default run
    "test_recovery.py::test_past_max_recoveries_the_run_fails_naming_every_loss": ("",),
    # the same address coming back, as test_the_worker_restarted_at_its_address... runs it by default
    "test_recovery.py::test_a_worker_that_dials_in_again_under_its_name_takes_its_stage_back": ("",),
    "test_recovery.py::test_a_pulled_cable_that_comes_back_gives_the_stage_back_to_its_worker": ("",),
    # new local workers and a checkpoint restored, as test_local_workers_recover... runs by default
    "test_recovery.py::test_replicas_recover_and_train_as_one_pipeline": ("",),
    "test_qlora.py::test_qlora_as_people_write_it_trains_as_locally": ("4",),
    "test_zoo.py::test_deferred_batch_norm_updates_running_statistics_once_per_mini_batch": ("traced",),
    "test_schedules.py::test_accumulated_clipped_steps_and_replicas_train_as_locally": ("1f1b",),
    "test_schedules.py::test_three_stages_with_values_that_skip_a_stage_and_lora_train_as_locally": ("1f1b",),
    "test_generate.py::test_every_decoding_mode_writes_what_the_model_writes_in_one_process": (
        "gpt2",
        "mixtral",
        "lora_llama",
    ),
    "test_signatures.py::test_trained_with_labels_and_validated_without_them_trains_as_locally": (
        "True-2-SGD",
        "False-4-SGD",
    ),
    "test_trace.py::test_huggingface_decoders_unchanged": ("gpt2",),
    "test_signatures.py::test_a_fifth_way_of_calling_is_refused_naming_the_argument_that_differs": ("",),
    "test_lan.py::test_a_large_message_on_a_slow_link_is_no_stall": ("dial-in",),
    "test_connect.py::test_setup_waits_for_a_late_worker_without_losing_the_early_one": ("dial-in",),
}


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        test, _, case = item.nodeid.rpartition("/")[2].partition("[")
        if case[:-1] in SLOW.get(test, ()):  # "name[case]", or "name" (case "")
            item.add_marker(pytest.mark.slow)


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
def dial_in():
    """``dial_in(port, name, *args)`` starts a worker that dials ``tcp://127.0.0.1:port`` as
    ``name``; returns its address (``dial://name``). Every one is killed when the test ends."""
    procs: list[subprocess.Popen] = []

    def start(port: int, name: str, *args: str) -> str:
        argv = ["--connect", f"tcp://127.0.0.1:{port}", "--name", name, "--allow-module", "lrmp_testlayers", *args]
        proc = subprocess.Popen(lrmp_lan.worker_command(*argv), **lrmp_lan.WORKER_OUTPUT)
        procs.append(proc)
        start.pids[name] = proc.pid
        return WorkerOutput(proc).wait_ready(time.monotonic() + 120)

    start.pids = {}
    yield start
    for proc in procs:
        proc.kill()
    for proc in procs:
        proc.wait(10)


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
