"""Every HuggingFace architecture through lrmp: a tiny config of each, trained locally and remotely.

For each model type in transformers' ``MODEL_FOR_CAUSAL_LM_MAPPING_NAMES``,
``MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES`` and ``MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES``,
the script builds a tiny config generically (`shrink`: every size the config has, made small; a
few families need more, `OVERRIDES`), fine-tunes the model with its own loss (``labels=``) on padded
batches for 2 steps with SGD, once in one process and once through lrmp on 2 stages (two local
workers) at m = 1 and 4, and compares step by step:

- PASS: losses within 2e-5 and weights within 1e-4 at both m;
- WRONG: lrmp trained, but not what local training did;
- REFUSED: lrmp refused the model (its error's first line);
- CRASH: anything else, a hang included (each case runs in its own process, bounded by --timeout);
- SKIP: the tiny config does not build or train locally (why).

    python scripts/hf_sweep.py                                  # all of them: about an hour on 2 cores
    python scripts/hf_sweep.py --tasks causal --only llama gpt2 # some
    python scripts/hf_sweep.py --out sweep.md                   # also write the table to a file
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import subprocess
import sys
import tempfile
import time
from typing import Any

TASKS = ("causal", "seqcls", "seq2seq")
VOCAB, SEQ, BATCH, LABELS = 128, 12, 4, 3
#: Sizes a config may have, and the small value each gets.
SMALL = {
    "vocab_size": VOCAB,
    "hidden_size": 32,
    "d_model": 32,
    "n_embd": 32,
    "embed_dim": 32,
    "dim": 32,
    "intermediate_size": 64,
    "ffn_dim": 64,
    "d_ff": 64,
    "n_inner": 64,
    "encoder_ffn_dim": 64,
    "decoder_ffn_dim": 64,
    "moe_intermediate_size": 16,
    "shared_expert_intermediate_size": 16,
    "num_hidden_layers": 2,
    "n_layer": 2,
    "num_layers": 2,
    "n_layers": 2,
    "encoder_layers": 2,
    "decoder_layers": 2,
    "num_decoder_layers": 2,
    "num_attention_heads": 4,
    "n_head": 4,
    "n_heads": 4,
    "encoder_attention_heads": 4,
    "decoder_attention_heads": 4,
    "num_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 8,
    "d_kv": 8,
    "kv_lora_rank": 16,
    "q_lora_rank": 16,
    "qk_rope_head_dim": 4,
    "qk_nope_head_dim": 4,
    "v_head_dim": 8,
    "max_position_embeddings": 64,
    "n_positions": 64,
    "num_experts": 4,
    "num_local_experts": 4,
    "n_routed_experts": 4,
    "num_experts_per_tok": 2,
    "first_k_dense_replace": 1,
    "sliding_window": 8,
    "state_size": 8,
    "conv_kernel": 4,
    "time_step_rank": 4,
    "expand": 2,
    "rotary_dim": 4,
    "num_latents": 8,
    "d_latents": 32,
    "num_self_attends_per_block": 2,
}
#: Families whose tiny config needs more than `SMALL` (by model type).
OVERRIDES: dict[str, dict[str, Any]] = {}


def shrink(config: Any) -> Any:
    """``config`` with every size of `SMALL` it has made small, its sub-configs too, and no dropout
    (local and remote training draw their random numbers differently)."""
    for name, value in SMALL.items():
        if type(getattr(config, name, None)) is int:
            _set(config, name, value)
    for name, value in config.to_dict().items():
        if type(value) is float and any(k in name for k in ("dropout", "pdrop", "layerdrop", "jitter")):
            _set(config, name, 0.0)
    for name in ("text_config", "decoder", "encoder"):
        sub = getattr(config, name, None)
        if sub is not None and hasattr(sub, "to_dict"):
            shrink(sub)
    for name, value in OVERRIDES.get(getattr(config, "model_type", ""), {}).items():
        _set(config, name, value)
    for name in ("pad_token_id", "bos_token_id", "eos_token_id", "decoder_start_token_id"):
        if hasattr(config, name):
            _set(config, name, 0 if name == "pad_token_id" else 1)
    if getattr(config, "is_encoder_decoder", False):  # labels= are shifted right behind it
        _set(config, "decoder_start_token_id", 1)
    _set(config, "use_cache", False)
    config.num_labels = LABELS
    return config


def _set(config: Any, name: str, value: Any) -> None:
    try:
        setattr(config, name, value)
    except AttributeError:  # a property computed from others (Falcon's head_dim)
        pass


def model_names(task: str) -> dict[str, str]:
    from transformers.models.auto import modeling_auto as auto

    mapping = {
        "causal": auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES,
        "seqcls": auto.MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES,
        "seq2seq": auto.MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES,
    }[task]
    return {k: v if isinstance(v, str) else v[0] for k, v in mapping.items()}


# --- one case, in a child process ---------------------------------------------------------------


def run_case(model_type: str, task: str, hosts: list[str], ms: list[int]) -> dict[str, Any]:
    import lightning as L
    import torch
    import transformers

    from lightning_remote_mp import LrmpError, RemoteModelParallelStrategy

    def build() -> Any:
        config = shrink(transformers.AutoConfig.for_model(model_type))
        torch.manual_seed(0)
        return getattr(transformers, model_names(task)[model_type])(config).train()

    class Data(torch.utils.data.Dataset):
        def __init__(self) -> None:
            g = torch.Generator().manual_seed(0)
            self.ids = torch.randint(2, VOCAB, (8, SEQ), generator=g)
            self.mask = (torch.arange(SEQ) < torch.randint(SEQ // 2, SEQ + 1, (8, 1), generator=g)).long()

        def __len__(self) -> int:
            return len(self.ids)

        def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
            ids = self.ids[i].masked_fill(self.mask[i] == 0, 0)
            labels = ids.masked_fill(self.mask[i] == 0, -100) if task != "seqcls" else ids[0] % LABELS
            return {"input_ids": ids, "attention_mask": self.mask[i], "labels": labels}

    class Tune(L.LightningModule):
        def __init__(self, model: Any) -> None:
            super().__init__()
            self.model, self.losses = model, []

        def training_step(self, batch, batch_idx):
            loss = self.model(**batch).loss
            self.losses.append(loss.item())
            return loss

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.05)

    def fit(module: Any, strategy: Any) -> None:
        with tempfile.TemporaryDirectory(prefix="lrmp-sweep-") as root:
            trainer = L.Trainer(
                max_steps=2,
                strategy=strategy,
                accelerator="cpu",
                logger=False,
                enable_progress_bar=False,
                enable_model_summary=False,
                enable_checkpointing=False,
                default_root_dir=root,
            )
            trainer.fit(module, torch.utils.data.DataLoader(Data(), batch_size=BATCH))

    try:
        local = Tune(build())
        start = copy.deepcopy(local)
        fit(local, "auto")
        if not local.losses or not all(map(lambda v: v == v, local.losses)):
            return {"result": "SKIP", "note": "the tiny config's loss is not a number locally"}
    except Exception as err:  # noqa: BLE001 - any failure here is the tiny config's
        return {"result": "SKIP", "note": f"local: {type(err).__name__}: {_first_line(err)}"}
    print("LOCAL DONE", flush=True)  # what follows is lrmp's
    outcome: dict[str, Any] = {"result": "PASS", "note": "", "m": {}}
    for m in ms:
        remote = copy.deepcopy(start)
        try:
            fit(remote, RemoteModelParallelStrategy(hosts=hosts, split=["model"], microbatches=m))
        except LrmpError as err:
            return {"result": "REFUSED", "note": f"m={m}: {type(err).__name__}: {_first_line(err)}"}
        except Exception as err:  # noqa: BLE001
            return {"result": "CRASH", "note": f"m={m}: {type(err).__name__}: {_first_line(err)}"}
        if any(t.is_meta for t in remote.state_dict().values()):  # a config past gather_limit is not tiny
            return {
                "result": "SKIP",
                "note": "the tiny config's weights are past gather_limit: they stay on the workers",
            }
        loss = max((abs(a - b) for a, b in zip(local.losses, remote.losses)), default=float("inf"))
        weights = max(
            (a - b).abs().max().item() if a.numel() else 0.0
            for a, b in zip(local.state_dict().values(), remote.state_dict().values())
        )
        outcome["m"][m] = [loss, weights]
        if len(local.losses) != len(remote.losses) or not loss <= 2e-5 or not weights <= 1e-4:
            outcome["result"] = "WRONG"
            outcome["note"] = f"m={m}: losses differ by {loss:.1e}, weights by {weights:.1e}"
    return outcome


def _first_line(err: BaseException) -> str:
    return (str(err).strip().splitlines() or [""])[0][:300]


# --- the sweep ----------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tasks", nargs="+", default=list(TASKS), choices=TASKS)
    p.add_argument("--only", nargs="+", help="these model types only")
    p.add_argument("--limit", type=int, help="the first N model types of each task")
    p.add_argument("--m", type=int, nargs="+", default=[1, 4])
    p.add_argument("--timeout", type=float, default=240.0, help="seconds per case, both m included")
    p.add_argument("--out", help="also write the table here")
    p.add_argument("--case", nargs=2, metavar=("MODEL_TYPE", "TASK"), help=argparse.SUPPRESS)
    p.add_argument("--hosts", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.case:
        print("RESULT " + json.dumps(run_case(args.case[0], args.case[1], args.hosts.split(","), args.m)), flush=True)
        return 0

    import transformers

    from lightning_remote_mp.driver.launch import LocalWorkers

    rows, counts = [], {}
    workers = LocalWorkers(2, devices=["cpu", "cpu"], threads=1)
    workers.start()
    started = time.monotonic()
    try:
        for task in args.tasks:
            names = sorted(model_names(task))
            if args.only:
                names = [n for n in names if n in args.only]
            for model_type in names[: args.limit]:
                t0 = time.monotonic()
                cmd = [sys.executable, os.path.abspath(__file__), "--case", model_type, task]
                cmd += ["--hosts", ",".join(workers.addresses), "--m", *map(str, args.m)]
                try:
                    done = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout)
                    line = next((ln for ln in done.stdout.splitlines() if ln.startswith("RESULT ")), None)
                    if line is None:
                        tail = (done.stderr.strip().splitlines() or ["no output"])[-1]
                        local = "LOCAL DONE" in done.stdout  # else the tiny config's own run died (memory)
                        result = {
                            "result": "CRASH" if local else "SKIP",
                            "note": f"exit {done.returncode}: {tail[:300]}",
                        }
                    else:
                        result = json.loads(line[len("RESULT ") :])
                except subprocess.TimeoutExpired as late:
                    local = "LOCAL DONE" in (late.stdout or b"").decode(errors="replace")
                    what = "lrmp gave no result" if local else "the local run did not end"
                    result = {"result": "CRASH" if local else "SKIP", "note": f"{what} within {args.timeout:.0f} s"}
                if not all(p.poll() is None for p in workers.procs):  # a case took a worker down
                    workers.stop()
                    workers = LocalWorkers(2, devices=["cpu", "cpu"], threads=1)
                    workers.start()
                counts[result["result"]] = counts.get(result["result"], 0) + 1
                note = result.get("note", "").replace("|", "\\|")
                rows.append(f"| {model_type} | {task} | {result['result']} | {note} | {time.monotonic() - t0:.0f} |")
                print(rows[-1], file=sys.stderr, flush=True)
    finally:
        workers.stop()
    trained = sum(v for k, v in counts.items() if k != "SKIP")
    header = (
        f"transformers {transformers.__version__}, m = {' and '.join(map(str, args.m))}, 2 stages; "
        f"{time.monotonic() - started:.0f} s. "
        + ", ".join(f"{k}: {v}" for k, v in sorted(counts.items()))
        + (f"; PASS {counts.get('PASS', 0) / trained:.0%} of those that train locally" if trained else "")
    )
    table = "\n".join([header, "", "| model type | task | result | note | s |", "|---|---|---|---|---|", *rows])
    print(table)
    if args.out:
        with open(args.out, "w") as f:
            f.write(table + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
