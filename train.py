"""piper-moe trainer: one entrypoint for every layout, launched with torchrun.

    # the default job (tiny preset, PP=2 x EP=2 on 4 CPU processes, gloo): what `make train` runs
    torchrun --standalone --nproc-per-node 4 train.py --config configs/tiny.toml
    # one process, no torchrun needed
    python train.py --config configs/tiny.toml --parallel.ep=1 --train.steps=50
    # override anything: --section.field=value; model fields go under --model.<field>
    torchrun --standalone --nproc-per-node 4 train.py --config configs/tiny.toml \
        --parallel.ep=4 --model.n_routed_experts=16 --data ./my_text_dir
    # tensor + sequence parallel: TP=2 x EP=2 on 4 processes (TP pairs are consecutive ranks)
    torchrun --standalone --nproc-per-node 4 train.py --config configs/tiny.toml \
        --parallel.pp=1 --parallel.tp=2 --parallel.ep=2 --parallel.sp=true
    # continue from the newest complete checkpoint in train.out_dir
    torchrun --standalone --nproc-per-node 4 train.py --config configs/tiny.toml --resume
    # elastic: relaunch after a rank dies, resuming from the last complete checkpoint
    torchrun --standalone --nproc-per-node 4 --max-restarts 3 train.py --config configs/tiny.toml \
        --train.resume=auto --train.ckpt_every=20
    # lose a node, keep training: each node's agent joins an elastic rendezvous of 1-2 nodes;
    # an attempt with another world size than its checkpoint re-plans the layout (planner)
    TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 torchrun --nnodes 1:2 --nproc-per-node 2 \
        --max-restarts 3 --rdzv-backend c10d --rdzv-endpoint HOST:29500 --rdzv-id job1 \
        train.py --config configs/tiny.toml --train.resume=auto --train.replan=auto \
        --train.platform=local --train.ckpt_every=20
    # multi-node (one agent per node; NCCL on GPUs, gloo on CPUs)
    torchrun --nnodes 2 --nproc-per-node 8 --rdzv-backend c10d --rdzv-endpoint HOST:29500 \
        train.py --config configs/tiny.toml --parallel.ep=8

`python train.py --help` lists every section and field.
"""

from __future__ import annotations

import os
import sys

import torch
import torch.distributed as dist


def _restart_safe_store(rank: int, world: int, timeout) -> dict:
    """Under torchrun's agent store (static rendezvous, `--master-port`), workers relaunched by
    `--max-restarts` would read the dead attempt's keys from the same store and connect to dead
    peers (pytorch/pytorch#135712). A key prefix per restart attempt keeps attempts apart."""
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return {}
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]),
                          is_master=False, timeout=timeout)
    return {"store": dist.PrefixStore(f"/piper-attempt-{attempt}", store), "rank": rank,
            "world_size": world}


def _report_bad_request(e: ValueError, rank: int) -> int:
    """Rank 0 prints the one `error:` line; the others stay silent. They also wait a moment
    before exiting: torchrun stops every worker as soon as one exits non-zero, and a rank that
    finished validating first would otherwise get rank 0 killed before it printed."""
    if rank == 0:
        print(f"error: {e}", file=sys.stderr, flush=True)
    else:
        import time

        time.sleep(5.0)
    return 2


def check_local_gpus(local_world: int, visible_gpus: int) -> None:
    """On a CUDA machine every local process takes `cuda:LOCAL_RANK`: with more processes than
    visible GPUs the extra ranks would die later on an invalid device ordinal. `visible_gpus`
    is `torch.cuda.device_count()` (0 where CUDA is unavailable: gloo on the CPU, no check)."""
    if visible_gpus > 0 and local_world > visible_gpus:
        raise ValueError(
            f"{local_world} local processes (LOCAL_WORLD_SIZE) but {visible_gpus} visible GPU(s) "
            f"(torch.cuda.device_count()); each process needs its own GPU. Launch "
            f"--nproc-per-node {visible_gpus} (or fewer), pick GPUs with CUDA_VISIBLE_DEVICES=..., "
            f'or train on the CPU (gloo) with CUDA_VISIBLE_DEVICES=""')


def _init_process_group(cfg, rank: int, world: int) -> None:
    from datetime import timedelta

    if world > 1 and not dist.is_initialized():
        backend = "nccl" if torch.cuda.is_available() else "gloo"
        timeout = timedelta(seconds=cfg.train.timeout_s)
        dist.init_process_group(backend, timeout=timeout, **_restart_safe_store(rank, world, timeout))


def _planner(*args, **kw):
    """`tuner.replan.runnable_layouts`, imported only when an attempt re-plans (the tuner
    package takes seconds to import: optuna, the estimate model)."""
    from tuner.replan import runnable_layouts

    return runnable_layouts(*args, **kw)


def _fb_memory(*args, **kw):
    """`tuner.fb_memory.fb_memory_of_run`, imported only when --comm.a2a_overlap=auto asks
    whether fb fits (across nodes, >= 2 micro-batches)."""
    from tuner.fb_memory import fb_memory_of_run

    return fb_memory_of_run(*args, **kw)


def main(argv: list[str]) -> int:
    from trainer import Trainer, parse_args, prepare
    from trainer.elastic import resolve
    from trainer.loop import TrainingError

    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", str(world)))
    try:
        cfg = parse_args(argv)
        check_local_gpus(local_world, torch.cuda.device_count() if torch.cuda.is_available() else 0)
        threads = cfg.train.threads or max(1, (os.cpu_count() or 1) // local_world)
        pinned = None
        if not torch.cuda.is_available():  # before the gloo threads start: they inherit it
            from comm.tools.affinity import pin_local_rank

            pinned = pin_local_rank(cfg.train.cpu_affinity, int(os.environ.get("LOCAL_RANK", "0")),
                           local_world, threads, world)
        # elastic restarts: the layout of this attempt's world size (re-planned by rank 0 when
        # it differs from the checkpoint's: the one step that needs the process group early)
        cfg, record = resolve(cfg, world, rank, _planner,
                              lambda: _init_process_group(cfg, rank, world))
        prep = prepare(cfg, world, rank)  # every check on the request happens here, before any work
        prep.elastic = record
        prep.fb_memory = _fb_memory
        prep.cpu_cores = pinned
    except ValueError as e:
        code = _report_bad_request(e, rank)
        if dist.is_initialized():
            dist.destroy_process_group()
        return code
    torch.set_num_threads(threads)
    _init_process_group(cfg, rank, world)
    try:
        Trainer(prep).run()
        if dist.is_initialized():
            dist.barrier()  # no rank tears down its connections while a peer still uses them
    except ValueError as e:  # e.g. a checkpoint that turns out unreadable while loading
        return _report_bad_request(e, rank)
    except TrainingError as e:  # every rank reports its own view (rank, phase, step)
        print(f"error: {e}", file=sys.stderr, flush=True)
        return 1
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
