"""A pre-imported interpreter that forks one child per train.py run the tests ask for.

Every train.py launch of a test used to start a fresh interpreter and import torch, DCP and the
trainer again: ~5 s of CPU each on the 2-core CI machine, for ~70 launches in the default tier.
A zygote process (one per pytest process, started on first use) imports them once and then, per
request, forks a child that runs train.py exactly as `python train.py ARGS` would (as
`__main__`, with the request's argv, environment, stdout and stderr files and exit-code rules),
or, for nproc > 1, runs tests/forklaunch.py's launcher in the child (ranks forked from it).
Nothing of the trainer runs in the zygote itself: it only imports, so every child starts from
the same untouched state (no threads, no OpenMP pool, no process group).

    client = Zygote.shared()          # in the test process
    rc, out, err = client.run(argv, nproc, port, env, timeout)

`run_train` in conftest.py uses it when the request's environment differs from the one the
zygote was started with only in variables read at run time (`RUNTIME_ENV_PREFIXES`); anything
else (another PYTHONPATH, TRITON_INTERPRET, ...) gets a fresh process as before.

Protocol (one request per connection on a Unix socket): the client sends one JSON line
{"argv", "nproc", "port", "env", "stdout", "stderr"}; the zygote answers {"pid": child} at once
and {"rc": exit code} when the child has exited. The child leads its own session, so a client
whose timeout expires kills the whole run with killpg, as subprocess.run's timeout would.
"""

from __future__ import annotations

import atexit
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import traceback
from pathlib import Path

import forklaunch  # tests/, next to this file: on sys.path when run as a script or by pytest

ROOT = Path(__file__).resolve().parents[1]
# Variables the trainer reads while it runs, not when a module is imported: a request may set
# these differently from the zygote's environment.
RUNTIME_ENV_PREFIXES = ("WANDB_",)


def _child(req: dict) -> int:
    """In the forked child: become `python train.py ARGV` (or the fork launcher) and run."""
    os.setsid()
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGCHLD):
        signal.signal(sig, signal.SIG_DFL)
    os.environ.clear()
    os.environ.update(req["env"])
    os.chdir(ROOT)
    for fd, path in ((1, req["stdout"]), (2, req["stderr"])):
        f = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(f, fd)
        os.close(f)
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    os.close(devnull)
    try:
        if req["nproc"] > 1:
            return forklaunch.main([str(req["nproc"]), str(req["port"]), *req["argv"]])
        import runpy

        sys.argv = [str(ROOT / "train.py"), *req["argv"]]
        runpy.run_path(str(ROOT / "train.py"), run_name="__main__")
        return 0
    except SystemExit as e:
        return forklaunch.exit_status(e)
    except BaseException:
        traceback.print_exc()
        return 1


def serve(sock_path: str) -> None:
    """The zygote: import once, then fork a child per request, one request at a time."""
    try:  # die with the test process that started us (Linux; elsewhere the client kills us)
        import ctypes

        ctypes.CDLL(None).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass
    sys.path[0] = str(ROOT)  # what `python train.py` has first (we were started from tests/)
    # what every run imports (measured with -X importtime): pay it once. torch._dynamo comes
    # in lazily with the optimizer's first step (~1.3 s), TensorBoard with the metrics writer.
    import torch._dynamo  # noqa: F401
    import torch.distributed.checkpoint  # noqa: F401
    import torch.utils.tensorboard  # noqa: F401

    import train  # noqa: F401
    import trainer.loop  # noqa: F401

    srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    srv.bind(sock_path)
    srv.listen(1)
    print("ready", flush=True)
    sys.stdout.flush()
    sys.stderr.flush()
    while True:
        conn, _ = srv.accept()
        try:
            _handle(srv, conn)
        except OSError:  # the client gave up (its timeout) and closed the connection
            pass
        finally:
            conn.close()


def _handle(srv: socket.socket, conn: socket.socket) -> None:
    f = conn.makefile("rw")
    line = f.readline()
    if not line:
        return
    req = json.loads(line)
    pid = os.fork()
    if pid == 0:
        srv.close()
        conn.close()
        code = _child(req)
        try:
            atexit._run_exitfuncs()  # what the interpreter runs at exit
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code)
    try:
        f.write(json.dumps({"pid": pid}) + "\n")
        f.flush()
    finally:  # reap the child whatever the client does
        _, status = os.waitpid(pid, 0)
    f.write(json.dumps({"rc": os.waitstatus_to_exitcode(status)}) + "\n")
    f.flush()


class Zygote:
    """The test process's handle on its zygote (started on first use, stopped at exit)."""

    _shared: Zygote | None = None
    _lock = threading.Lock()

    def __init__(self, env: dict[str, str]) -> None:
        self.env = dict(env)
        self.dir = tempfile.mkdtemp(prefix="piper-zygote-")
        self.sock = os.path.join(self.dir, "sock")
        self.proc = subprocess.Popen([sys.executable, str(Path(__file__)), "serve", self.sock],
                                     cwd=ROOT, env=self.env, stdout=subprocess.PIPE, text=True)
        ready = self.proc.stdout.readline() if self.proc.stdout else ""
        if ready.strip() != "ready":
            self.proc.kill()
            raise RuntimeError(f"the test zygote did not start (said {ready!r}, "
                               f"exit {self.proc.poll()})")
        atexit.register(self.close)

    @classmethod
    def shared(cls, env: dict[str, str]) -> Zygote:
        with cls._lock:
            if cls._shared is None or cls._shared.proc.poll() is not None:
                cls._shared = cls(env)
            return cls._shared

    def accepts(self, env: dict[str, str]) -> bool:
        """Whether a run with `env` can start from this zygote's imports."""
        keys = set(env) | set(self.env)
        return all(env.get(k) == self.env.get(k) or k.startswith(RUNTIME_ENV_PREFIXES)
                   for k in keys)

    def run(self, argv: list[str], nproc: int, port: int, env: dict[str, str],
            timeout: float) -> subprocess.CompletedProcess:
        """Run train.py ARGV in a fork; the result as subprocess.run(capture_output=True) gives."""
        out = tempfile.NamedTemporaryFile(dir=self.dir, suffix=".out", delete=False).name
        err = tempfile.NamedTemporaryFile(dir=self.dir, suffix=".err", delete=False).name
        req = {"argv": argv, "nproc": nproc, "port": port, "env": env, "stdout": out,
               "stderr": err}
        args = ["zygote", "train.py", *argv]
        try:
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
                s.connect(self.sock)
                s.settimeout(timeout)
                f = s.makefile("rw")
                f.write(json.dumps(req) + "\n")
                f.flush()
                pid = json.loads(f.readline())["pid"]
                try:
                    rc = json.loads(f.readline())["rc"]
                except TimeoutError:
                    try:
                        os.killpg(pid, signal.SIGKILL)
                    except ProcessLookupError:
                        pass
                    raise subprocess.TimeoutExpired(args, timeout, Path(out).read_text(),
                                                    Path(err).read_text()) from None
            return subprocess.CompletedProcess(args, rc, Path(out).read_text(),
                                               Path(err).read_text())
        finally:
            for p in (out, err):
                Path(p).unlink(missing_ok=True)

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        Path(self.sock).unlink(missing_ok=True)
        try:
            os.rmdir(self.dir)
        except OSError:
            pass


if __name__ == "__main__":
    if len(sys.argv) != 3 or sys.argv[1] != "serve":
        sys.exit("usage: python tests/zygote.py serve SOCKET_PATH")
    serve(sys.argv[2])
