"""Run N ranks of train.py as forks of one interpreter that imported the trainer once.

    python tests/forklaunch.py NPROC MASTER_PORT [train.py arguments...]

What torchrun gives each worker that train.py reads (RANK, LOCAL_RANK, WORLD_SIZE,
LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT; a static rendezvous on rank 0's TCPStore) and what its
agent does when a worker fails (stop the others, exit 1), without paying the interpreter start-up
and `import torch` + trainer once per rank plus once for the agent: on a 2-core CI machine that
start-up is most of a short multi-process test (~2-4 s of CPU per process). Every rank still is
its own process with its own gloo connections; the trainer code runs unchanged. Tests that need
torchrun itself (restarts, elastic rendezvous, the agent's store) launch torchrun
(`run_train(..., launcher="torchrun")`, benchmarks/chaos.py).

Fork safety: the parent only imports (no tensor work, no threads started; OMP_NUM_THREADS=1 from
the caller), then forks before any rank initialises anything.
"""

from __future__ import annotations

import os
import signal
import sys
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
GRACE_S = 10.0  # after a rank fails, the others get this long to exit before SIGKILL


def exit_status(e: SystemExit) -> int:
    """The exit status Python gives `sys.exit(code)`: None -> 0, an int -> it, text -> printed
    to stderr and 1 (argparse's --help / usage errors, sys.exit("message"))."""
    if isinstance(e.code, str):
        print(e.code, file=sys.stderr)
        return 1
    return int(e.code or 0)


def _rank(rank: int, nproc: int, port: str, argv: list[str]) -> int:
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(nproc),
                      LOCAL_WORLD_SIZE=str(nproc), GROUP_RANK="0", ROLE_RANK=str(rank),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
    import train

    sys.argv = ["train.py", *argv]
    try:
        return train.main(argv)
    except SystemExit as e:
        return exit_status(e)
    except BaseException:
        traceback.print_exc()
        return 1


def main(args: list[str]) -> int:
    if len(args) < 2 or not args[0].isdigit() or not args[1].isdigit() or int(args[0]) < 1:
        print("usage: python tests/forklaunch.py NPROC MASTER_PORT [train.py arguments...]",
              file=sys.stderr)
        return 2
    nproc, port, argv = int(args[0]), args[1], args[2:]
    os.chdir(ROOT)
    sys.path.insert(0, str(ROOT))
    import torch.distributed.checkpoint  # noqa: F401  (imported by every rank: pay it once)

    import train  # noqa: F401
    import trainer.loop  # noqa: F401

    sys.stdout.flush()
    sys.stderr.flush()
    pids: dict[int, int] = {}
    for rank in range(nproc):
        pid = os.fork()
        if pid == 0:
            code = 1
            try:
                code = _rank(rank, nproc, port, argv)
            finally:
                sys.stdout.flush()
                sys.stderr.flush()
                os._exit(code)
        pids[pid] = rank
    failed, deadline = 0, None
    while pids:
        if deadline is None:
            pid, status = os.wait()
        else:
            pid, status = os.waitpid(-1, os.WNOHANG)
            if pid == 0:
                if time.monotonic() > deadline:
                    for p in pids:
                        os.kill(p, signal.SIGKILL)
                    deadline = float("inf")
                time.sleep(0.1)
                continue
        rank = pids.pop(pid)
        code = os.waitstatus_to_exitcode(status)
        if code != 0 and not failed:
            failed = 1
            print(f"[forklaunch] rank {rank} exited with {code}; stopping the others",
                  file=sys.stderr, flush=True)
            for p in pids:  # as torchrun's agent does when a worker fails
                os.kill(p, signal.SIGTERM)
            deadline = time.monotonic() + GRACE_S
    return failed


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
