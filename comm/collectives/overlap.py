"""Row exchanges that run while the caller computes: a start, a wait, and autograd around them.

`start_exchange(x, plan, group)` posts the exchange of `plan` (from `comm.plan_all_to_all`, its
`reverse()`, or a flat `AllToAllPlan` built from known splits) and returns an `Exchange`;
`Exchange.wait()` returns the rows received. How the exchange runs meanwhile:

    flat, any backend   `dist.all_to_all_single(..., async_op=True)`: gloo's worker threads
                        move the rows; NCCL runs it on its own stream, and `wait()` makes the
                        caller's stream wait for it (the host does not block)
    halo, gloo          one worker thread per process runs `comm.collectives.halo.halo_exchange` (HALO is
                        point-to-point with waits between its phases); exchanges are queued
                        FIFO, so every rank runs them in the order it started them
    halo, NCCL          on a communication stream that first waits for the caller's stream;
                        `wait()` makes the caller's stream wait for an event recorded after
                        it, and the input and output are recorded on both streams so the
                        caching allocator reuses neither while the other stream may read it

Every rank must start its exchanges in the same order (the MoE pipeline is a fixed schedule);
no exchange is waited on before every exchange before it in that order was started.

`exchange_start(x, handle)` / `exchange_wait(token, handle)` are the differentiable pair: the
start returns a 0-element token tensor that the wait consumes, so autograd runs their backward
passes in the mirrored order. The wait's backward starts the mirrored exchange of the gradient
(`handle.reverse`), and the start's backward waits for it: whatever ran between the start and
the wait in the forward runs its backward while the gradient's exchange is in flight (the
CPU and CUDA autograd engines run ready nodes latest-created first).
"""

from __future__ import annotations

import functools
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch
import torch.distributed as dist

from comm.collectives.alltoall import AllToAllPlan
from comm.collectives.dedup import p2p_start
from comm.collectives.halo import halo_exchange

__all__ = ["Baton", "Exchange", "ExchangeHandle", "exchange_start", "exchange_wait",
           "start_exchange"]

_executor: ThreadPoolExecutor | None = None
_executor_lock = threading.Lock()
_streams: dict[int, Any] = {}


def _worker() -> ThreadPoolExecutor:
    global _executor
    with _executor_lock:
        if _executor is None:
            _executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="comm-overlap")
        return _executor


def _comm_stream(device: torch.device) -> Any:
    idx = device.index if device.index is not None else torch.cuda.current_device()
    if idx not in _streams:
        _streams[idx] = torch.cuda.Stream(device=idx)
    return _streams[idx]


class Exchange:
    """One exchange in flight; `wait()` (exactly once) returns its output rows."""

    def __init__(self, y: torch.Tensor | None = None, work: Any = None,
                 future: Future | None = None, event: Any = None, keep: Any = None) -> None:
        self._y, self._work, self._future, self._event, self._keep = y, work, future, event, keep
        self.waited_s = 0.0  # host seconds `wait` blocked (the exposed part of the exchange)

    def wait(self) -> torch.Tensor:
        t0 = time.perf_counter()
        if self._work is not None:
            self._work.wait()
            self._work = None
        elif self._future is not None:
            self._y = self._future.result()
            self._future = None
        elif self._event is not None:
            assert self._y is not None
            cur = torch.cuda.current_stream(self._y.device)
            cur.wait_event(self._event)  # the caller's stream waits; the host does not
            self._y.record_stream(cur)  # made on the communication stream, read on this one
            self._event = None
        self._keep = None
        self.waited_s = time.perf_counter() - t0
        y = self._y
        if y is None:
            raise RuntimeError("Exchange.wait() called twice")
        self._y = None
        return y


def start_exchange(x: torch.Tensor, plan: AllToAllPlan, group: dist.ProcessGroup | None
                   ) -> Exchange:
    """Post the exchange of the rows of x [sum(plan.in_splits), ...] per `plan`; returns it
    in flight (module docstring)."""
    if x.shape[0] != sum(plan.in_splits):
        raise ValueError(f"x has {x.shape[0]} rows, the plan sends {sum(plan.in_splits)}")
    x = x.contiguous()
    if plan.algorithm == "flat":
        y = x.new_empty((sum(plan.out_splits), *x.shape[1:]))
        work = dist.all_to_all_single(y, x, list(plan.out_splits), list(plan.in_splits),
                                      group=group, async_op=True)
        return Exchange(y, work=work, keep=x)
    if plan.algorithm == "p2p":
        y, posted = p2p_start(x, plan, group)
        return Exchange(y, work=posted, keep=x)
    assert plan.splits is not None, "a HALO plan carries its split matrix"
    rank_plan = plan.splits.rank_plan(dist.get_rank(group))
    if x.is_cuda:
        cur = torch.cuda.current_stream(x.device)
        stream = _comm_stream(x.device)
        stream.wait_stream(cur)
        with torch.cuda.stream(stream):
            y = halo_exchange(x, rank_plan, group)
            event = torch.cuda.Event()
            event.record(stream)
        x.record_stream(stream)
        return Exchange(y, event=event, keep=x)
    return Exchange(future=_worker().submit(halo_exchange, x, rank_plan, group), keep=x)


class Baton:
    """Two parties, exactly one running at a time; `switch()` hands over (module docstring).

    Party 0 runs in the calling thread, party 1 in a helper thread that gets the caller's
    grad mode, CUDA device and intra-op thread count (all thread-local in torch; autocast
    too, which the callables set themselves). On CUDA the autograd engine runs a backward in
    its device thread: a switch from there blocks that thread, which is what it should do
    (the backward's party is paused). `switches` counts the hand-overs of the last pair."""

    def __init__(self) -> None:
        self._cv = threading.Condition()
        self._turn = -1  # the party running now; -1: no pair is running
        self._alive = [False, False]
        self.switches = 0

    def switch(self) -> None:
        """Called by the running party right after it started an exchange: the partner runs
        until its own next start or its end, then this party resumes. A no-op outside a pair
        and once the partner has ended."""
        with self._cv:
            me = self._turn
            if me < 0 or not self._alive[1 - me]:
                return
            self._turn = 1 - me
            self.switches += 1
            self._cv.notify_all()
            while self._turn != me:
                self._cv.wait()

    def pair(self, first: Callable[[], Any], second: Callable[[], Any]) -> tuple[Any, Any]:
        """Run first() and second() as the two parties, first() starting; returns both
        results. An exception in either is raised once both have ended (the other runs on
        alone, its switches no-ops)."""
        if self._turn != -1:
            raise RuntimeError("Baton.pair: a pair is already running on this baton")
        results: list[Any] = [None, None]
        errors: list[BaseException | None] = [None, None]
        grad, threads = torch.is_grad_enabled(), torch.get_num_threads()
        device = torch.cuda.current_device() if torch.cuda.is_initialized() else None

        def party(i: int, fn: Callable[[], Any]) -> None:
            with self._cv:
                while self._turn != i:
                    self._cv.wait()
            try:
                if i == 1:
                    torch.set_num_threads(threads)
                    if device is not None:
                        torch.cuda.set_device(device)
                with torch.set_grad_enabled(grad):
                    results[i] = fn()
            except BaseException as e:  # re-raised by pair() once both parties ended
                errors[i] = e
            finally:
                with self._cv:
                    self._alive[i] = False
                    self._turn = 1 - i if self._alive[1 - i] else -2
                    self._cv.notify_all()

        with self._cv:
            self._alive, self._turn, self.switches = [True, True], 0, 0
        helper = threading.Thread(target=party, args=(1, second), name="fb-baton", daemon=True)
        helper.start()
        party(0, first)
        helper.join()
        self._turn = -1
        for e in errors:
            if e is not None:
                raise e
        return results[0], results[1]

    def microbatches(self, m: int, forward: Callable[[int], Any],
                     backward: Callable[[Any], None]) -> None:
        """Gradient accumulation over m micro-batches with F and B paired: F(0); then B(j-1)
        paired with F(j) for j = 1..m-1 (B starting); then B(m-1). `forward(j)` returns what
        `backward` takes. The B's still run in order 0, 1, ..., so the gradients accumulate
        as in the plain loop."""
        prev = forward(0)
        for j in range(1, m):
            _, prev = self.pair(functools.partial(backward, prev), functools.partial(forward, j))
        backward(prev)


class ExchangeHandle:
    """What a start and its wait share: the plan, the group, the exchange in flight in each
    direction, the host seconds the waits blocked (`waited_s`, both directions), and the
    `Baton` its starts hand over (None: no interleaving)."""

    __slots__ = ("plan", "group", "_reverse", "fwd", "bwd", "waited_s", "baton")

    def __init__(self, plan: AllToAllPlan, group: dist.ProcessGroup | None,
                 reverse: AllToAllPlan | None = None, baton: Baton | None = None) -> None:
        self.plan, self.group, self._reverse, self.baton = plan, group, reverse, baton
        self.fwd: Exchange | None = None
        self.bwd: Exchange | None = None
        self.waited_s = 0.0

    @property
    def reverse(self) -> AllToAllPlan:
        if self._reverse is None:
            self._reverse = self.plan.reverse()
        return self._reverse


class _Start(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, h: ExchangeHandle) -> torch.Tensor:
        ctx.h = h
        h.fwd = start_exchange(x, h.plan, h.group)
        if h.baton is not None:  # the partner computes while this exchange is in flight
            h.baton.switch()
        return x.new_empty(0)

    @staticmethod
    def backward(ctx: Any, _token: torch.Tensor) -> tuple[torch.Tensor, None]:
        h = ctx.h
        assert h.bwd is not None, "the wait's backward starts the gradient's exchange"
        g = h.bwd.wait()
        h.waited_s += h.bwd.waited_s
        h.bwd = None
        return g, None


class _Wait(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, token: torch.Tensor, h: ExchangeHandle) -> torch.Tensor:
        ctx.h = h
        assert h.fwd is not None, "exchange_wait needs the token of exchange_start"
        y = h.fwd.wait()
        h.waited_s += h.fwd.waited_s
        h.fwd = None
        return y

    @staticmethod
    def backward(ctx: Any, grad_y: torch.Tensor) -> tuple[torch.Tensor, None]:
        h = ctx.h
        h.bwd = start_exchange(grad_y, h.reverse, h.group)
        if h.baton is not None:
            h.baton.switch()
        return grad_y.new_empty(0), None


def exchange_start(x: torch.Tensor, h: ExchangeHandle) -> torch.Tensor:
    """Start `h.plan`'s exchange of x; returns the token `exchange_wait` takes."""
    return _Start.apply(x, h)


def exchange_wait(token: torch.Tensor, h: ExchangeHandle) -> torch.Tensor:
    """The rows of the exchange `token` started (differentiable: module docstring)."""
    return _Wait.apply(token, h)
