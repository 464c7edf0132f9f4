"""Does the trainer run its forward + backward slower than a bare one? (issue 33, item 7)

Runs under torchrun with train.py's options; every rank builds the real `Trainer`, takes 3
warm-up steps, then alternates N times: one `Trainer.train_step()` (its `fwd_bwd_s`), one bare
forward + backward of the same model object on the same batch (no memory meter, no gradient
sync armed), and the same bare one under the trainer's memory meter. Interleaving puts the
three in the same load window, so their ratio is meaningful on a shared machine where the
absolute times are not. Prints each rank's medians (and the step's other parts) and appends
them to probe_trainer_vs_bare.jsonl (runs/bench/probe_trainer_vs_bare/, `--out`, or `--record`:
benchmarks/results/); every other argument is train.py's.

    OMP_NUM_THREADS=1 python -m torch.distributed.run --nproc-per-node 2 \\
        benchmarks/probe_trainer_vs_bare.py --model.preset=tiny --train.seq_len=256 \\
        --train.global_batch=16 --parallel.dp=2 --parallel.ep=1 --train.steps=20 \\
        --train.eval_every=0 --train.ckpt_every=0 --train.plot=false \\
        --train.tensorboard=false --train.memory_report=true --train.out_dir=runs/probe
    PROBE_ITERS=8 (default 6) sets N.
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
import time
from pathlib import Path

import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from _common import add_output_args, output_dir, probe_trainer, record_ranks  # noqa: E402

from model import cross_entropy  # noqa: E402


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_output_args(p, "probe_trainer_vs_bare")
    return p


def main(argv: list[str]) -> None:
    args, train_argv, cfg, tr, world, rank, n_iter = probe_trainer(parser(), argv, 6)
    parts, t = tr.parts, cfg.train
    res: dict[str, list[float]] = {}

    def bare(meter: bool) -> float:
        tokens, targets = parts.corpus.batch(0, t.global_batch, t.seq_len, parts.mesh.data_idx,
                                             parts.mesh.n_data_shards, cfg.data.seed)
        if world > 1:
            dist.barrier()
        m = cfg.parallel.microbatches
        t0 = time.perf_counter()
        with parts.stats.meter if meter else contextlib.nullcontext():
            for tok, tgt in zip(tokens.chunk(m), targets.chunk(m), strict=True):
                ((cross_entropy(parts.model(tok), tgt) + parts.model.aux_loss()) / m).backward()
        dt = time.perf_counter() - t0
        for p in parts.model.parameters():
            p.grad = None
        return dt

    for _ in range(3):
        tr.train_step()
    for _ in range(n_iter):
        r = tr.train_step()
        for k in ("fwd_bwd_s", "step_time_s", "grad_sync_s", "optim_s"):
            res.setdefault("trainer_" + k, []).append(getattr(r, k))
        res.setdefault("bare_fwd_bwd_s", []).append(bare(False))
        res.setdefault("bare_meter_fwd_bwd_s", []).append(bare(True))
    med = {k: round(statistics.median(v), 4) for k, v in res.items()}
    med["trainer_over_bare"] = round(med["trainer_fwd_bwd_s"] / med["bare_fwd_bwd_s"], 3)
    record_ranks(output_dir(args), "probe_trainer_vs_bare", rank, world, med, {"argv": train_argv, "iters": n_iter})


if __name__ == "__main__":
    main(sys.argv[1:])
