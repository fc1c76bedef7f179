"""Generation through the workers of two versions of lrmp, in one run (issue #48): what a change gained.

On a shared machine whose speed drifts by a quarter within minutes, two runs of
``benchmarks/generate.py`` an hour apart say little about a change of a few milliseconds a token.
This script starts two pools of local workers, one importing lrmp from ``--base`` (a checkout of
another version: ``git worktree add /tmp/base 839adcc``, 0.15.3), one from this checkout, and alternates
rounds of ``generate()`` through each with the same model's ``generate()`` in this process. The
driver is this checkout's in both (the two versions must speak the same protocol). The model, the
prompts and the timing are `generate`'s (a 22 M Llama, greedy, a thread per worker at one
micro-batch by default).

    git worktree add /tmp/base 839adcc && python benchmarks/versions.py --base /tmp/base   # ~4 min
    python benchmarks/versions.py --base /tmp/base --stages 4 --rounds 4
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import _common  # noqa: E402
import generate  # noqa: E402


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--base", required=True, help="a checkout of the other version (its repository root)")
    p.add_argument("--stages", type=int, default=2)
    p.add_argument("--threads", type=int, default=1, help="torch threads per worker and for local generation")
    p.add_argument("--rounds", type=int, default=6)
    p.add_argument("--repeats", type=int, default=2, help="timed generations per mode and round")
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--prompt", type=int, default=128)
    return p.parse_args(argv)


def start_pool(stages: int, threads: int, root: str | None) -> Any:
    """Local workers importing lrmp from ``root`` (their path is the driver's, `LocalWorkers`), or from here."""
    from lightning_remote_mp.driver.launch import LocalWorkers

    pool = LocalWorkers(stages, threads=threads)
    if root is None:
        pool.start()
        return pool
    here = os.getcwd()
    sys.path.insert(0, root)
    os.chdir(root)
    try:
        pool.start()
    finally:
        os.chdir(here)
        sys.path.remove(root)
    return pool


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    _common.exit_on_sigterm()
    generate.quiet()
    base = os.path.abspath(args.base)
    if not os.path.isfile(os.path.join(base, "lightning_remote_mp", "_version.py")):
        raise SystemExit(f"--base {args.base}: not a checkout of lightning_remote_mp")
    model = generate.make_model(
        generate.parse_args(["--prompt", str(args.prompt), "--new-tokens", str(args.new_tokens)])
    )
    ids = generate.make_prompts(1, args.prompt, model.config.vocab_size)
    mode = generate.Mode("lrmp", 1, args.stages, 1, args.threads)
    local = generate.Mode("local", 1, threads=args.threads)
    pools = {"this checkout": start_pool(args.stages, args.threads, None)}
    try:
        pools["--base"] = start_pool(args.stages, args.threads, base)
        print(_common.environment())
        print(
            f"--base {base}; {args.stages} stages, {args.threads} thread(s) each; batch 1, {args.new_tokens} new tokens"
        )
        runs: dict[str, list[dict[str, Any]]] = {}
        order = ["local", "--base", "this checkout"]
        for r in range(args.rounds):
            for which in order if r % 2 == 0 else order[::-1]:
                if which == "local":
                    got = generate.run_local(model, local, ids, args.new_tokens, args.repeats)
                else:
                    got = generate.run_lrmp(model, mode, pools[which].addresses, ids, args.new_tokens, args.repeats)
                runs.setdefault(which, []).extend(got)
                print(
                    f"  round {r}: {which:14s} {_common.median(x['decode_s'] for x in got) * 1e3:7.2f} ms/token",
                    flush=True,
                )
    finally:
        for pool in pools.values():
            pool.stop()
    med = _common.median
    at_local = med(x["decode_s"] for x in runs["local"])
    rows = []
    for which, got in runs.items():
        lrmp, per_token = which != "local", med(x["decode_s"] for x in got)
        rows.append(
            [
                which,
                generate.ms(per_token),
                f"{(per_token - at_local) * 1e3:+.2f}" if lrmp else "-",
                generate.ms(med(x["call_s"] for x in got)),
                generate.ms(med(x["compute_s"] for x in got)),
                generate.ms(med(x["transfer_s"] for x in got)) if lrmp else "-",
                generate.ms(med(x["other_s"] for x in got)) if lrmp else "-",
            ]
        )
    print()
    header = [
        "workers",
        "ms/token",
        "vs local",
        "model call",
        "compute",
        "stage->stage msgs only",
        "driver msgs, dispatch",
    ]
    print(_common.markdown_table(header, rows))
    _common.exit_now(0)
    return 0


if __name__ == "__main__":
    sys.exit(main())
