"""Depth: how a model's first step, first token and warm decoding grow with its number of decoder
layers, through lrmp and in one process (issue #60).

The model is a Llama with a 70B's depth and tiny widths (hidden 64, 4 heads, MLP 128, vocabulary
512), so that compute is small and what lrmp spends per layer shows. Each run is the issue's: a
`LightningModule` fine-tuning it on batches of 2 x 64 tokens, 6 training steps
(``RemoteModelParallelStrategy(split=["model"], microbatches=2)`` on the two local workers it starts,
or the same Trainer in this process), then one validation that calls ``generate()`` of 16 new tokens
(greedy) three times. Measured, each configuration in a fresh process:

- **first step**: from ``fit`` to the end of the first training step (the workers' start, the
  trace, the placement);
- **first generate()**: the first call (the prefill's and the decode step's traces and placements);
- **warm token**: the least time per new token of the two later calls.

``--apart`` adds lrmp runs whose local workers are processes of their own, each importing torch,
rather than forked by one server that imported it once (`lightning_remote_mp.worker.forkserver`).
``--base DIR`` adds the same lrmp runs with another checkout's lrmp (its root on the children's
``PYTHONPATH``: the driver and the workers import it), e.g. ``git worktree add /tmp/base 0f607a1``.
The local runs compute with one torch thread, as each local worker does.

    python benchmarks/depth.py                              # 8, 20, 40, 80 layers (~3 min on 2 cores)
    python benchmarks/depth.py --base /tmp/base             # and another version beside it
    python benchmarks/depth.py --layers 8 --apart           # and local workers started apart
    python benchmarks/depth.py --quick                      # 2 and 6 layers, smoke run
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import _common  # noqa: E402

NEW_TOKENS = 16


def child(layers: int, variant: str, steps: int) -> dict:
    """One run, in this process (see the module docstring)."""
    import warnings

    import lightning as L
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from lightning_remote_mp import RemoteModelParallelStrategy

    warnings.filterwarnings("ignore")
    torch.manual_seed(0)
    if variant == "local":
        torch.set_num_threads(1)
    config = LlamaConfig(
        vocab_size=512,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=4,
        max_position_embeddings=256,
    )
    marks: dict = {"generate": []}

    class FineTune(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.model = LlamaForCausalLM(config)

        def training_step(self, batch, batch_idx):
            return self.model(input_ids=batch[0], labels=batch[0]).loss

        def on_train_batch_end(self, *args) -> None:
            marks.setdefault("first_step", time.perf_counter())

        def validation_step(self, batch, batch_idx):
            for _ in range(3):
                start = time.perf_counter()
                self.model.generate(batch[0][:, :8], max_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=0)
                marks["generate"].append(time.perf_counter() - start)

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=1e-3)

    data = torch.utils.data.TensorDataset(torch.randint(0, 512, (2 * steps, 64)))
    train = torch.utils.data.DataLoader(data, batch_size=2)
    val = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.randint(0, 512, (1, 64))), batch_size=1)
    if variant == "apart":
        from lightning_remote_mp.driver import launch

        launch.FORKS = False  # each local worker a process of its own, importing torch itself
    strategy = "auto" if variant == "local" else RemoteModelParallelStrategy(split=["model"], microbatches=2)
    trainer = L.Trainer(
        strategy=strategy,
        accelerator="cpu",
        devices=1,
        max_steps=steps,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        limit_val_batches=1,
        val_check_interval=steps,
    )
    start = time.perf_counter()
    trainer.fit(FineTune(), train, val)
    first, *warm = marks["generate"]
    return {
        "first_step": marks["first_step"] - start,
        "first_generate": first,
        "warm_token": min(warm) / NEW_TOKENS,
        "fit": time.perf_counter() - start,
    }


def run_child(layers: int, variant: str, steps: int, base: str | None, timeout: float) -> dict:
    env = _common.child_env(threads=1)
    if variant == "base":
        env["PYTHONPATH"] = base + os.pathsep + env.get("PYTHONPATH", "")
    cmd = [_common.python(), os.path.abspath(__file__), "--child", str(layers), variant, "--steps", str(steps)]
    cwd = base if variant == "base" else None
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout, cwd=cwd)
    lines = [line for line in out.stdout.splitlines() if line.startswith("{")]
    if out.returncode or not lines:
        raise RuntimeError(f"{layers} layers, {variant}: exit {out.returncode}\n{out.stderr[-3000:]}")
    return json.loads(lines[-1])


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--layers", type=int, nargs="+", default=[8, 20, 40, 80])
    p.add_argument("--base", help="another checkout of lrmp (its repository root), run beside this one")
    p.add_argument("--apart", action="store_true", help="and lrmp with local workers started apart, not forked")
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--quick", action="store_true", help="2 and 6 layers, 2 steps")
    p.add_argument("--out", default=os.path.join(HERE, "results"))
    p.add_argument("--child", nargs=2, metavar=("LAYERS", "VARIANT"), help=argparse.SUPPRESS)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.child:
        print(json.dumps(child(int(args.child[0]), args.child[1], args.steps)), flush=True)
        return 0
    if args.quick:
        args.layers, args.steps = [2, 6], 2
    variants = ["local", "lrmp"] + (["apart"] if args.apart else []) + (["base"] if args.base else [])
    results: dict[str, dict[str, dict]] = {}
    for layers in args.layers:
        for variant in variants:
            got = run_child(layers, variant, args.steps, args.base, timeout=900)
            results.setdefault(str(layers), {})[variant] = got
            print(f"{layers} layers, {variant}: " + ", ".join(f"{k} {v:.3f}" for k, v in got.items()), flush=True)
    names = {"local": "local", "lrmp": "lrmp", "apart": "lrmp, workers apart"}
    names["base"] = f"lrmp at {os.path.basename(args.base or '')}"
    rows = []
    first = str(args.layers[0])
    for layers in map(str, args.layers):
        for v in variants:
            r, low = results[layers][v], results[first][v]

            def grown(key: str, r: dict = r, low: dict = low, layers: str = layers) -> str:
                return "" if layers == first else f" ({r[key] / low[key]:.2f}x)"

            rows.append(
                [
                    layers,
                    names[v],
                    f"{r['first_step']:.2f} s{grown('first_step')}",
                    f"{r['first_generate']:.2f} s{grown('first_generate')}",
                    f"{1e3 * r['warm_token']:.1f} ms",
                ]
            )
    table = _common.markdown_table(
        ["layers", "run", f"first step (x {first} layers')", f"first generate() (x {first} layers')", "warm token"],
        rows,
    )
    print(table)
    os.makedirs(args.out, exist_ok=True)
    stem = os.path.join(args.out, "depth" + ("_quick" if args.quick else ""))
    with open(stem + ".json", "w") as f:
        json.dump({"environment": _common.environment(), "results": results}, f, indent=1)
    with open(stem + ".txt", "w") as f:
        f.write(table + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
