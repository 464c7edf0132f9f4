"""Execute a pipeline schedule over a process group: `PipelineRuntime`.

Every rank walks its own slot list of the (validated) schedule. P2P is derived, never
hand-written: after its step-t slot (an action or idle) a rank posts one `batch_isend_irecv`
holding the step-t *boundary*: the receives of everything its peers produce for it at step t
and the sends of everything it produced at step t. `comm_plan` gives both ends of every rank
pair the same (step, producer) order and every transfer a unique tag, so matching is
deterministic. A rank blocks only when an action needs a tensor that has not arrived yet;
sends complete in the background and are waited for at the end of `step`.

Why the boundary batch, and why no host sync inside a step (NCCL). A communicator runs its
operations on one stream, in issue order, and a receive kernel does not finish before the
peer's send kernel runs. Posting step t's receives before the action and its sends after it
(as a first version did) queues, on both ranks of a pair that exchange at the same step
(at p=2, M=8: 6 steps of 1F1B, 18 of interleaved 1F1B with v=2), "recv(t)" ahead of "send(t)", and each recv(t)
waits for a send(t) queued behind the peer's own recv(t): a deadlock on the GPU, and on the
host too once something (a `torch.cuda.synchronize` to time the action) waits for it. In
one batch, NCCL runs the sends and receives of a boundary as one group, which progresses
as a whole. The price, on gloo too (one code path): a receive goes up when the receiving
rank finishes its step-t slot rather than before it, so a transfer no longer overlaps the
receiver's step-t action (an A/B of benchmarks/bench_pipeline.py at p=2, M=8 on a shared
CPU showed bubbles within its run-to-run noise).

One global issue order (PP P2P and EP collectives). Stage modules run collectives on other
communicators inside forward and backward (the EP all-to-all, its split exchange, HALO's
P2P batches), on the calling thread. NCCL can deadlock when two communicators' operations
are issued in different orders on different ranks, so give every operation a key:
(t, 0, i) for the i-th collective inside the step-t action, (t, 1) for the step-t boundary
batch. Each rank issues its operations in increasing key order (the program order above).
Every participant of an operation gives it the same key: the members of an EP group share a
pipeline position (`trainer.distributed.mesh`: same pp index), hence the same slot list, and run the same
action at step t, whose collectives come in the same program order (the MoE layers run
their exchanges whatever the routing, never skipping one on some ranks); both ends of a P2P
transfer post it in their step-t batch, t being the producer's step; the one collective of
the runtime itself (`_ready_group`, first step only) comes before all of them on every rank
of the PP group. So the operations of all ranks follow one total order, and by induction
over it each operation starts once its participants have issued everything before it:
nothing waits on an operation with a larger key, so nothing deadlocks. Host syncs inside an
action (e.g. reading the all-to-all's split sizes) wait on the current stream only, hence
on operations up to the current key, which every participant issues before it blocks the
same way; they keep this property; a device-wide sync while a receive
of the current step is posted (the first version) does not.
`tests/test_pipeline_order.py` records the issue sequence per rank and communicator of real
gloo runs (PP=2 x EP=2 with a flat all-to-all in every stage) and checks that one order
exists (no cycle after merging matched operations), and that the old order has a cycle.

Gradients: the loss of micro-batch m is scaled by 1/M before backward, so after `step` the
stage modules' `.grad` hold the gradient of the mean micro-batch loss (= the full-batch mean
for equal micro-batches and a mean-reduced loss). Grads accumulate; zero them between steps.

Split backward (stages that have W actions, e.g. `zb-h1`): B computes only the input
gradient (`torch.autograd.grad(..., retain_graph=True)`) and sends it upstream; W later
computes the parameter gradients from the gradients B recorded at the graph nodes where the
weight paths branch off (`pipeline.split_backward`), so W does not repeat B's work; the graph
is freed after W. On a stage whose input needs no gradient (stage 0 fed with token ids) B
has nothing to compute and W does the whole backward.

Auxiliary losses (e.g. the MoE load-balancing term): pass `aux_fn(stage, module, output) ->
Tensor | None`. It is called right after each stage forward; a returned scalar is scaled by
1/M and added to that micro-batch's objective (backpropagated along with the stage output).
The returned per-micro-batch losses exclude it; its values are kept in `last_aux`.

Timing: every action is timed (waits for incoming tensors are not part of a span, so they
show up as bubble): with `clock` on the CPU; on a GPU with CUDA events on the current stream,
read after the step's last wait (the runtime blocks the host on the device only at the start
of a step and after its last wait: `_host_sync`, never with a receive outstanding). `spans` holds this
rank's `Span`s of the last step; `gather_spans()` collects all ranks' on every rank.

Forward-only schedules (`pipeline.forward_only`, evaluation): the same walk, P2P and issue
order, without autograd (no graph is kept, nothing is stashed for a backward); `step` returns
the last stage's per-micro-batch losses as for training.

Legend: M micro-batches, p pipeline ranks, s stage, m micro-batch.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Generic, TypeVar, cast

import torch
import torch.distributed as dist
from torch import nn
from torch.profiler import record_function

from comm.collectives.overlap import Baton
from pipeline.analysis import (
    Span,
    Transfer,
    comm_plan,
    derive_transfers,
    is_forward_only,
    validate,
)
from pipeline.schedule import Action, AnySchedule, Pair, members, n_stages, stage2rank
from pipeline.split_backward import WeightWork, backward_input, backward_weight

__all__ = ["PipelineRuntime"]

StageT = TypeVar("StageT", bound=nn.Module)  # the stage modules' class (aux_fn receives them)
AuxFn = Callable[[int, StageT, torch.Tensor], "torch.Tensor | None"]


class PipelineRuntime(Generic[StageT]):
    """Runs `schedule` on this rank's stages.

    schedule   `{pp_rank: [Action | None]}`, e.g. from `pipeline.build`; validated here.
    stages     `{stage_index: nn.Module}` for exactly the stages the schedule puts on this rank.
    loss_fn    `loss_fn(output, target) -> scalar`, applied on the last stage.
    act_shape  shape of the tensor crossing each stage boundary for one micro-batch (one
               tuple for all, or `{s: shape of stage s's output}`); gradients share it.
    dtype      dtype of those tensors; default: the stages' `boundary_dtype` when they declare
               one (`trainer.distributed.pipe.Stage`: bf16 under autocast), else fp32.
    group      the PP process group (None = WORLD); its rank i runs `schedule[i]`.
    device     where receive buffers live (default: the first stage's parameters' device).
    aux_fn     optional auxiliary-loss hook (see the module docstring).
    clock      time source for spans (default `time.perf_counter`: one host).
    """

    def __init__(
        self,
        schedule: AnySchedule,
        stages: Mapping[int, StageT],
        loss_fn: Callable[[torch.Tensor, Any], torch.Tensor],
        act_shape: Sequence[int] | Mapping[int, Sequence[int]],
        *,
        dtype: torch.dtype | None = None,
        group: dist.ProcessGroup | None = None,
        device: torch.device | str | None = None,
        aux_fn: AuxFn[StageT] | None = None,
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        validate(schedule)
        self.group = group
        self.rank = dist.get_rank(group)
        world = dist.get_world_size(group)
        if world != len(schedule):
            raise ValueError(
                f"schedule has {len(schedule)} ranks but the PP group has {world}; they must match"
            )
        s2r = stage2rank(schedule)
        mine = sorted(s for s, r in s2r.items() if r == self.rank)
        if sorted(stages) != mine:
            raise ValueError(
                f"rank {self.rank} got modules for stages {sorted(stages)}, but the schedule "
                f"runs stages {mine} here"
            )
        self.schedule = schedule
        self.stages = dict(stages)
        self.loss_fn = loss_fn
        self.aux_fn = aux_fn
        self.dtype = dtype if dtype is not None else self._boundary_dtype(self.stages)
        self.clock = clock
        self.n_stages = n_stages(schedule)
        self.n_microbatches = 1 + max(
            a.microbatch for slots in schedule.values() for s in slots for a in members(s)
        )
        self._s2r = s2r
        self.split = {a.stage for s in schedule[self.rank] for a in members(s) if a.kind == "W"}
        # a paired schedule (pipeline.build_fb): its pairs run on this baton, which the stages'
        # EP dispatchers hand over at their exchange starts during `step`
        self.baton = Baton() if any(isinstance(s, Pair) for s in schedule[self.rank]) else None
        self.forward_only = is_forward_only(schedule)
        self._shape = self._shapes(act_shape)
        if device is None:
            params = [p for s in mine for p in self.stages[s].parameters()]
            device = params[0].device if params else torch.device("cpu")
        self.device = torch.device(device)
        # Unique tag per transfer (its index in the global derived list): the same on both
        # ends, so even a transport that matches by tag cannot pair the wrong tensors.
        self._tag = {x: i for i, x in enumerate(derive_transfers(schedule))}
        self._ops_at: dict[int, list[tuple[str, int, Transfer]]] = {}
        for op in comm_plan(schedule, self.rank):
            self._ops_at.setdefault(op[2].step, []).append(op)
        self.spans: list[Span] = []
        self.last_aux: dict[tuple[int, int], float] = {}
        self._group_ready = False

    @staticmethod
    def _boundary_dtype(stages: Mapping[int, nn.Module]) -> torch.dtype:
        declared = {s: getattr(m, "boundary_dtype", torch.float32) for s, m in stages.items()}
        if len(set(declared.values())) > 1:
            raise ValueError(f"stages declare different boundary dtypes {declared}; pass dtype=")
        return next(iter(declared.values()), torch.float32)

    def _shapes(self, act_shape: Sequence[int] | Mapping[int, Sequence[int]]) -> dict[int, tuple]:
        if isinstance(act_shape, Mapping):
            missing = [s for s in range(self.n_stages - 1) if s not in act_shape]
            if missing:
                raise ValueError(f"act_shape lacks stage boundaries {missing} (outputs of stages)")
            return {s: tuple(act_shape[s]) for s in range(self.n_stages - 1)}
        return {s: tuple(act_shape) for s in range(self.n_stages - 1)}

    # -- P2P ------------------------------------------------------------------------------

    def _post(self, t: int) -> None:
        """Post the step-t boundary as one batch: the receives of what peers produced at step
        t, then the sends of what this rank produced at step t (see the module docstring)."""
        ops = self._ops_at.get(t, [])
        ops = [o for o in ops if o[0] == "recv"] + [o for o in ops if o[0] == "send"]
        if not ops:
            return
        p2p = []
        for kind, peer, x in ops:
            if kind == "recv":
                shape = self._shape[min(x.producer.stage, x.consumer.stage)]
                buf = torch.empty(shape, dtype=self.dtype, device=self.device)
                self._inbox[x.consumer] = buf
                p2p.append(dist.P2POp(dist.irecv, buf, group=self.group, group_peer=peer,
                                      tag=self._tag[x]))
            else:
                buf = self._outbox.pop(x.producer)
                p2p.append(dist.P2POp(dist.isend, buf, group=self.group, group_peer=peer,
                                      tag=self._tag[x]))
                self._sent.append(buf)  # keep alive until the send completes
        works = dist.batch_isend_irecv(p2p)
        for i, (kind, _, x) in enumerate(ops):
            if kind == "recv":
                # One work per op (gloo) or one for the whole coalesced batch (NCCL).
                mine = [works[i]] if len(works) == len(p2p) else works
                self._pending.setdefault(x.consumer, []).extend(mine)
        self._send_works.extend(works)

    def _take(self, consumer: Action) -> torch.Tensor:
        """The tensor `consumer` needs from another stage (waits for it if remote)."""
        if consumer in self._local:
            return self._local.pop(consumer)
        for work in self._pending.pop(consumer, []):
            self._wait(work)
        return self._inbox.pop(consumer)

    def _wait(self, work: dist.Work) -> None:
        # Waiting twice on a finished gloo Work blocks forever (torch 2.13), and with NCCL
        # one Work covers a whole batch: wait on each exactly once.
        if id(work) not in self._waited:
            work.wait()
            self._waited[id(work)] = work

    def _hand_off(self, producer: Action, consumer: Action, tensor: torch.Tensor) -> None:
        shape = self._shape[min(producer.stage, consumer.stage)]
        if tuple(tensor.shape) != shape or tensor.dtype != self.dtype:
            raise ValueError(
                f"{producer} produced {tuple(tensor.shape)} {tensor.dtype} for {consumer}, but "
                f"the runtime was told {shape} {self.dtype} (act_shape/dtype)"
            )
        tensor = tensor.detach()
        if self._s2r[consumer.stage] == self.rank:
            self._local[consumer] = tensor
        else:
            self._outbox[producer] = tensor.contiguous()

    def _ready_group(self) -> None:
        """Once per runtime, before its first batch: one collective over the PP group. NCCL
        creates a group's communicator at its first operation, and `batch_isend_irecv` as
        that first operation needs every rank of the group in the call (torch documents
        anything else as undefined); the step-0 batch involves only the ranks that hand off
        at step 0."""
        if self._group_ready:
            return
        if dist.get_world_size(self.group) > 1:
            dist.all_reduce(torch.zeros(1, device=self.device), group=self.group)
        self._group_ready = True

    def _host_sync(self, why: str) -> None:
        """The only points where the runtime blocks the host on the device: `why` is "step
        start" (before any receive of the step is posted) or "spans" (after every receive and
        send of the step has been waited for). Stream-local: the current stream, not the
        device. A no-op on CPU; tests wrap it to check that no receive is outstanding."""
        if self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()

    # -- actions --------------------------------------------------------------------------

    def _forward(self, a: Action, inputs: Sequence[Any] | None, targets: Sequence[Any] | None) -> None:
        s, m = a.stage, a.microbatch
        if s == 0:
            assert inputs is not None, "step() checks that stage 0's rank has its inputs"
            x = inputs[m]
            if isinstance(x, torch.Tensor):
                x = x.to(self.device)
        else:
            x = self._take(a)
            if not self.forward_only:
                x.requires_grad_()
        module = self.stages[s]
        y = module(x)
        extra = []
        if self.aux_fn is not None:
            aux = self.aux_fn(s, module, y)
            if aux is not None:
                self._aux[(s, m)] = aux.detach()  # read after the step: no host sync here
                extra.append(aux * self._scale)
        if s == self.n_stages - 1:
            assert targets is not None, "step() checks that the last stage's rank has targets"
            loss = self.loss_fn(y, targets[m])
            self._losses[m] = loss.detach()
            outs = [loss * self._scale + sum(extra)] if extra else [loss * self._scale]
        else:
            self._hand_off(a, Action(s + 1, "F", m), y)
            outs = [y] + extra
        if not self.forward_only:  # the backward's inputs
            self._stash[(s, m)] = (x, outs)

    def _backward(self, a: Action) -> None:
        s, m = a.stage, a.microbatch
        x, outs = self._stash[(s, m)]
        grads: list[torch.Tensor | None]
        if s < self.n_stages - 1:
            grads = [self._take(a), *(torch.ones_like(o) for o in outs[1:])]
        else:
            grads = [None]  # the scalar loss seeds itself
        x_needs = isinstance(x, torch.Tensor) and x.requires_grad
        if s in self.split:
            params = list(self.stages[s].parameters())
            if x_needs:
                dx, work = backward_input(outs, grads, x, params)
            else:
                dx, work = None, WeightWork([], plain=(outs, grads))
            self._stash[(s, m)] = (x, work)
        else:
            torch.autograd.backward(outs, grads)
            dx = x.grad if x_needs else None
            del self._stash[(s, m)]
        if s > 0:
            if dx is None:
                dx = torch.zeros(self._shape[s - 1], dtype=self.dtype, device=self.device)
            self._hand_off(a, Action(s - 1, "B", m), dx)

    def _weight(self, a: Action) -> None:
        _, work = self._stash.pop((a.stage, a.microbatch))
        backward_weight(work, list(self.stages[a.stage].parameters()))

    # -- public ---------------------------------------------------------------------------

    def step(
        self, inputs: Sequence[Any] | None, targets: Sequence[Any] | None
    ) -> list[torch.Tensor] | None:
        """Run one schedule. `inputs[m]` feeds stage 0 (needed on its rank only), `targets[m]`
        goes to `loss_fn` on the last stage. Returns the M per-micro-batch losses (detached,
        unscaled, without aux terms) on the last stage's rank, None elsewhere."""
        M = self.n_microbatches
        if 0 in self.stages and (inputs is None or len(inputs) != M):
            raise ValueError(f"rank {self.rank} runs stage 0 and needs {M} inputs, got "
                             f"{None if inputs is None else len(inputs)}")
        last = self.n_stages - 1
        if last in self.stages and (targets is None or len(targets) != M):
            raise ValueError(f"rank {self.rank} runs the last stage and needs {M} targets, got "
                             f"{None if targets is None else len(targets)}")
        self._scale = 1.0 / M
        self._inbox: dict[Action, torch.Tensor] = {}
        self._outbox: dict[Action, torch.Tensor] = {}
        self._local: dict[Action, torch.Tensor] = {}
        self._pending: dict[Action, list[dist.Work]] = {}
        self._send_works: list[dist.Work] = []
        self._waited: dict[int, dist.Work] = {}  # holds the Works so their ids stay unique
        self._sent: list[torch.Tensor] = []
        self._stash: dict[tuple[int, int], tuple] = {}
        self._losses: dict[int, torch.Tensor] = {}
        self.spans = []
        self.last_aux = {}
        self._aux: dict[tuple[int, int], torch.Tensor] = {}
        self._ready_group()
        disps = self._dispatchers() if self.baton is not None else []
        for d in disps:
            d.baton = self.baton
        try:
            with torch.set_grad_enabled(torch.is_grad_enabled() and not self.forward_only):
                self._walk(inputs, targets)
        finally:
            for d in disps:
                d.baton = None
        if last not in self.stages:
            return None
        return [self._losses[m] for m in range(M)]

    def _dispatchers(self) -> list[Any]:
        """The EP dispatchers of this rank's stages (`comm.ep.EPDispatcher`: what has a
        `baton`); the runtime knows them only by that attribute."""
        out: list[Any] = []
        for module in self.stages.values():
            for m in module.modules():
                d = getattr(m, "dispatcher", None)
                if d is not None and hasattr(d, "baton") and all(d is not o for o in out):
                    out.append(d)
        return out

    def _run(self, a: Action, inputs: Sequence[Any] | None, targets: Sequence[Any] | None
             ) -> None:
        # profiler ranges (torch.profiler; nearly free when no profiler is active)
        with record_function(f"pipeline.{a.kind} s{a.stage} mb{a.microbatch}"):
            if a.kind == "F":
                self._forward(a, inputs, targets)
            elif a.kind == "B":
                self._backward(a)
            else:
                self._weight(a)

    def _walk(self, inputs: Sequence[Any] | None, targets: Sequence[Any] | None) -> None:
        """This rank's slots of the schedule, their boundary batches, the final waits. A
        pair's members both have their inputs from earlier steps (`validate`), so both are
        received before the pair runs; then B and F run on the baton, B starting."""
        last = self.n_stages - 1
        timer = _Timer(self.device, self.clock, self._host_sync)
        for t, slot in enumerate(self.schedule[self.rank]):
            acts = members(slot)
            for a in acts:
                # Inputs from other ranks are awaited before the span starts: waiting is bubble.
                if a.kind == "F" and a.stage > 0 or a.kind == "B" and a.stage < last:
                    with record_function("pipeline.wait_recv"):
                        self._local[a] = self._take(a)
            if len(acts) == 2:
                assert self.baton is not None and isinstance(slot, Pair)
                mark = timer.start()
                with record_function(f"pipeline.pair {slot}"):
                    self.baton.pair(functools.partial(self._run, slot.b, inputs, targets),
                                    functools.partial(self._run, slot.f, inputs, targets))
                timer.stop_pair(slot, mark)
            elif acts:
                mark = timer.start()
                self._run(acts[0], inputs, targets)
                timer.stop(acts[0], mark)
            self._post(t)
        with record_function("pipeline.wait_sends"):
            for work in self._send_works:
                self._wait(work)
        leftovers = list(self._inbox) + list(self._local) + list(self._stash)
        if leftovers:
            raise RuntimeError(f"rank {self.rank} finished with unconsumed state {leftovers}")
        # Every receive of the step has been waited for: only now may the host block on the
        # device (CUDA events of the spans).
        self.spans = timer.spans(self.rank)
        if self._aux:
            values = torch.stack([v.float().reshape(()) for v in self._aux.values()]).tolist()
            self.last_aux = dict(zip(self._aux, values, strict=True))
        self._sent.clear()
        self._send_works.clear()
        self._waited.clear()

    def gather_spans(self) -> list[Span]:
        """All ranks' spans of the last step (a collective over the PP group)."""
        out: list[list[Span] | None] = [None] * dist.get_world_size(self.group)
        dist.all_gather_object(out, self.spans, group=self.group)
        return [s for spans in cast(list[list[Span]], out) for s in spans]  # all filled in


class _Timer:
    """Spans of one step's actions. CPU: `clock` around each action. CUDA: a pair of events
    on the current stream per action (no host wait inside the step), converted to `clock`
    time once the step's communication is over: the step start syncs the current stream and
    reads `clock` with a first event, so `clock() + elapsed(first, e)` is when e ran."""

    def __init__(self, device: torch.device, clock: Callable[[], float],
                 host_sync: Callable[[str], None]) -> None:
        self.cuda = device.type == "cuda"
        self.clock = clock
        self.host_sync = host_sync
        self.marks: list[tuple[Action | Pair, Any, Any]] = []
        host_sync("step start")
        if self.cuda:
            self.t0 = clock()
            self.ev0 = self._event()

    @staticmethod
    def _event() -> torch.cuda.Event:
        ev = torch.cuda.Event(enable_timing=True)
        ev.record()
        return ev

    def start(self) -> Any:
        return self._event() if self.cuda else self.clock()

    def stop(self, a: Action, start: Any) -> None:
        self.marks.append((a, start, self._event() if self.cuda else self.clock()))

    def stop_pair(self, pair: Pair, start: Any) -> None:
        self.marks.append((pair, start, self._event() if self.cuda else self.clock()))

    def spans(self, rank: int) -> list[Span]:
        self.host_sync("spans")
        if self.cuda:
            at = lambda ev: self.t0 + self.ev0.elapsed_time(ev) / 1e3  # noqa: E731 (ms -> s)
            marks = [(a, at(s), at(e)) for a, s, e in self.marks]
        else:
            marks = self.marks
        out = []
        for a, s, e in marks:
            if isinstance(a, Pair):  # halves: only the pair's sum is measured (analysis.Span)
                out += [Span(rank, a.b, s, (s + e) / 2), Span(rank, a.f, (s + e) / 2, e)]
            else:
                out.append(Span(rank, a, s, e))
        return out
