"""`python -m trainer.data order`: the windows the trainer reads, step by step, as JSON lines.

    python -m trainer.data order --data SPEC --seq S --global-batch B --dp D --steps N --seed s

SPEC is a token file (or text file / folder, as `--data` takes) or a blend `a.bin:0.7,b.bin:0.3`.
The first line is `{"windows_per_epoch": n}` (a blend: `{"windows_per_epoch": {file: n}}`), then
one object per (step, data rank): `{"step", "rank", "starts": [...], "file": FILE}` (a blend:
`"files": [...]`, the file of each start, beside `starts`). Steps are numbered from 1 as in
metrics.jsonl; a start is the window's token offset in its file's training split (the file's
first 1 - val_fraction of tokens, which is where the file begins). `--dp` is the number of
data shards, dp x ep of the run. The trainer's `--debug.trace_data=true` writes the same rows.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Iterator
from typing import Any

from . import Blend, DataError, is_blend, load_data

__all__ = ["order_rows", "add_parser", "run"]


def order_rows(spec: str, seq: int, global_batch: int, dp: int, steps: int, seed: int,
               val_fraction: float = 0.005, sampling: str = "epoch",
               first_step: int = 1) -> Iterator[dict[str, Any]]:
    """The header row, then one row per (step, rank) for steps first_step .. first_step+steps-1."""
    for name, v in (("--seq", seq), ("--global-batch", global_batch), ("--dp", dp),
                    ("--first-step", first_step)):
        if v < 1:
            raise DataError(f"{name}={v} must be >= 1")
    if steps < 0:
        raise DataError(f"--steps={steps} must be >= 0")
    if global_batch % dp:
        raise DataError(f"--global-batch={global_batch} is not divisible by --dp={dp}; use a "
                        f"multiple of {dp}")
    blend = is_blend(spec)
    data = load_data("" if blend else spec, val_fraction, blend=spec if blend else "",
                     sampling=sampling)
    parts = data.parts if isinstance(data, Blend) else [data]
    for p in parts:
        if p.n_train < seq + 1:
            raise DataError(f"{p.source}: the training split has {p.n_train} tokens, fewer "
                            f"than --seq + 1 = {seq + 1}")
    n = {p.source: p.n_windows(seq) for p in parts}
    yield {"windows_per_epoch": n if blend else n[parts[0].source]}
    files = data.files
    for step in range(first_step, first_step + steps):
        for rank in range(dp):
            src, starts = data.windows(step - 1, global_batch, seq, rank, dp, seed)
            row: dict[str, Any] = {"step": step, "rank": rank, "starts": [int(s) for s in starts]}
            if blend:
                row["files"] = [files[i] for i in src]
            else:
                row["file"] = files[0]
            yield row


def add_parser(sub) -> None:
    p = sub.add_parser("order", help="print the windows each step and data rank reads (JSONL)",
                       description=__doc__.split("\n\n")[2],
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data", required=True, metavar="SPEC",
                   help="token file (or text file/folder), or a blend a.bin:0.7,b.bin:0.3")
    p.add_argument("--seq", type=int, required=True, help="--train.seq_len of the run")
    p.add_argument("--global-batch", type=int, required=True, help="--train.global_batch")
    p.add_argument("--dp", type=int, default=1, help="data shards (dp x ep of the run)")
    p.add_argument("--steps", type=int, required=True, help="steps to print")
    p.add_argument("--seed", type=int, default=1234, help="--data.seed (default 1234)")
    p.add_argument("--val-fraction", type=float, default=0.005, help="--data.val_fraction")
    p.add_argument("--sampling", default="epoch", help="--data.sampling: epoch | random")
    p.add_argument("--first-step", type=int, default=1, help="first step to print (1-based)")


def run(args) -> int:
    for row in order_rows(args.data, args.seq, args.global_batch, args.dp, args.steps,
                          args.seed, args.val_fraction, args.sampling, args.first_step):
        print(json.dumps(row), flush=False)
    return 0
