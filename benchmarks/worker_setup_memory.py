"""What a worker holds while its stage of a pretrained model is placed (issue #35).

A Llama-architecture model (vocab 32k, untied) is saved with ``save_pretrained``; two workers are
started, and a ``Trainer.validate`` through ``pretrained=`` places it (each worker reads its
stage's tensors from the files) and runs one batch. Each worker's ``RssAnon`` (its own memory) and
``RssFile`` (pages of mapped files, shared and evictable) are sampled every 0.05 s; the table gives
each one's peak growth over the idle worker, against its stage's weights (about half the model).
A stage held for evaluation needs its weights once; frozen weights stay pages of the files.

    python benchmarks/worker_setup_memory.py --sizes 0.8
"""

from __future__ import annotations

import argparse
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import environment, markdown_table  # noqa: E402
from big_model import SHAPES, save_model  # noqa: E402


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _status(pid: int) -> dict[str, int]:
    out = {}
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith(("RssAnon", "RssFile")):
                out[line.split(":")[0]] = int(line.split()[1]) * 1024
    return out


def measure(path: str) -> list[dict[str, int]]:
    import lightning as L
    import torch
    from torch.utils.data import DataLoader
    from transformers import AutoModelForCausalLM

    from lightning_remote_mp import RemoteModelParallelStrategy

    ports = [_free_port(), _free_port()]
    argv = [sys.executable, "-m", "lightning_remote_mp.worker", "--threads", "1"]
    quiet = {"stdout": subprocess.DEVNULL, "stderr": subprocess.DEVNULL}
    procs = [subprocess.Popen([*argv, "--bind", f"tcp://127.0.0.1:{p}"], **quiet) for p in ports]
    peaks = [{"RssAnon": 0, "RssFile": 0} for _ in procs]
    stop = threading.Event()

    def sample() -> None:
        while not stop.is_set():
            for peak, proc in zip(peaks, procs):
                try:
                    for k, v in _status(proc.pid).items():
                        peak[k] = max(peak[k], v)
                except OSError:
                    pass
            time.sleep(0.05)

    try:
        time.sleep(5)  # the workers are up and idle
        idle = [_status(p.pid) for p in procs]
        threading.Thread(target=sample, daemon=True).start()

        class Validate(L.LightningModule):
            def __init__(self) -> None:
                super().__init__()
                self.model = AutoModelForCausalLM.from_pretrained(path)

            def validation_step(self, batch, batch_idx):
                return self.model(input_ids=batch, labels=batch).loss

        strategy = RemoteModelParallelStrategy(
            hosts=[f"tcp://127.0.0.1:{p}" for p in ports], split=["model"], pretrained=path
        )
        data = DataLoader([torch.randint(0, 32000, (32,)) for _ in range(4)], batch_size=4)
        trainer = L.Trainer(
            strategy=strategy, accelerator="cpu", logger=False, enable_progress_bar=False, enable_model_summary=False
        )
        trainer.validate(Validate(), data)
    finally:
        stop.set()
        for p in procs:
            p.terminate()
            p.wait(30)
    return [{k: peak[k] - base[k] for k in peak} for peak, base in zip(peaks, idle)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", type=float, nargs="+", default=[0.8], choices=sorted(SHAPES))
    args = parser.parse_args()
    print(environment())
    rows = []
    for size in args.sizes:
        directory = tempfile.mkdtemp(prefix="lrmp-llama-")
        try:
            nbytes = save_model(size, directory)
            for stage, grown in enumerate(measure(directory)):
                rows.append(
                    [
                        f"{nbytes / 1e6:,.0f}",
                        stage,
                        f"{nbytes / 2e6:,.0f}",
                        f"{grown['RssAnon'] / 1e6:,.0f} ({grown['RssAnon'] / (nbytes / 2):.2f}x)",
                        f"{grown['RssFile'] / 1e6:,.0f}",
                    ]
                )
        finally:
            shutil.rmtree(directory, ignore_errors=True)
    header = ["model MB", "stage", "stage weights MB (about)", "worker +MB own (x stage)", "+MB mapped files"]
    print(markdown_table(header, rows))


if __name__ == "__main__":
    main()
