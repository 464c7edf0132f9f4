"""Execute a pipeline schedule over a process group: `PipelineRuntime`.

Every rank walks its own slot list of the (validated) schedule. P2P is derived, never
hand-written: before its own step-t action a rank posts (one `batch_isend_irecv`) the
receives of everything its peers produce for it at step t, and after the action the sends of
what it produced. Receives thus go up a step early (the batch holds receives only, so the
gloo rule "receives before sends" holds) and a transfer can start as soon as its producer
is done. `comm_plan` gives both ends of every rank pair the same (step, producer) order and
every transfer a unique tag, so matching is deterministic.
A rank blocks only when an action needs a tensor that has not arrived yet; sends complete in
the background and are waited for at the end of `step`.

Stage modules may run collectives on *other* process groups (e.g. EP all-to-alls) inside
forward or backward: those run on the calling thread in program order, while pipeline P2P
only uses the PP group, so the two never share a communicator.

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

Timing: every action is timed with `clock` (wall clock; waits for incoming tensors are not
part of a span, so they show up as bubble). `spans` holds this rank's `Span`s of the last
step; `gather_spans()` collects all ranks' on every rank.

Legend: M micro-batches, p pipeline ranks, s stage, m micro-batch.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from pipeline.analysis import Span, Transfer, comm_plan, derive_transfers, validate
from pipeline.schedule import Action, Schedule, n_stages, stage2rank
from pipeline.split_backward import WeightWork, backward_input, backward_weight

__all__ = ["PipelineRuntime"]

AuxFn = Callable[[int, nn.Module, torch.Tensor], "torch.Tensor | None"]


class PipelineRuntime:
    """Runs `schedule` on this rank's stages.

    schedule   `{pp_rank: [Action | None]}`, e.g. from `pipeline.build`; validated here.
    stages     `{stage_index: nn.Module}` for exactly the stages the schedule puts on this rank.
    loss_fn    `loss_fn(output, target) -> scalar`, applied on the last stage.
    act_shape  shape of the tensor crossing each stage boundary for one micro-batch (one
               tuple for all, or `{s: shape of stage s's output}`); gradients share it.
    dtype      dtype of those tensors (fp32 default).
    group      the PP process group (None = WORLD); its rank i runs `schedule[i]`.
    device     where receive buffers live (default: the first stage's parameters' device).
    aux_fn     optional auxiliary-loss hook (see the module docstring).
    clock      time source for spans (default `time.perf_counter`: one host).
    """

    def __init__(
        self,
        schedule: Schedule,
        stages: Mapping[int, nn.Module],
        loss_fn: Callable[[torch.Tensor, Any], torch.Tensor],
        act_shape: Sequence[int] | Mapping[int, Sequence[int]],
        *,
        dtype: torch.dtype = torch.float32,
        group: dist.ProcessGroup | None = None,
        device: torch.device | str | None = None,
        aux_fn: AuxFn | None = None,
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
        self.dtype = dtype
        self.clock = clock
        self.n_stages = n_stages(schedule)
        self.n_microbatches = 1 + max(
            a.microbatch for slots in schedule.values() for a in slots if a is not None
        )
        self._s2r = s2r
        self.split = {a.stage for a in schedule[self.rank] if a is not None and a.kind == "W"}
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

    def _shapes(self, act_shape: Sequence[int] | Mapping[int, Sequence[int]]) -> dict[int, tuple]:
        if isinstance(act_shape, Mapping):
            missing = [s for s in range(self.n_stages - 1) if s not in act_shape]
            if missing:
                raise ValueError(f"act_shape lacks stage boundaries {missing} (outputs of stages)")
            return {s: tuple(act_shape[s]) for s in range(self.n_stages - 1)}
        return {s: tuple(act_shape) for s in range(self.n_stages - 1)}

    # -- P2P ------------------------------------------------------------------------------

    def _post(self, t: int, which: str) -> None:
        """Post the `which` ("recv" or "send") operations of step t as one batch."""
        ops = [o for o in self._ops_at.get(t, []) if o[0] == which]
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
        if not p2p:
            return
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

    # -- actions --------------------------------------------------------------------------

    def _forward(self, a: Action, inputs: Sequence[Any] | None, targets: Sequence[Any] | None) -> None:
        s, m = a.stage, a.microbatch
        if s == 0:
            x = inputs[m]
            if isinstance(x, torch.Tensor):
                x = x.to(self.device)
        else:
            x = self._take(a).requires_grad_()
        module = self.stages[s]
        y = module(x)
        extra = []
        if self.aux_fn is not None:
            aux = self.aux_fn(s, module, y)
            if aux is not None:
                self.last_aux[(s, m)] = float(aux.detach())
                extra.append(aux * self._scale)
        if s == self.n_stages - 1:
            loss = self.loss_fn(y, targets[m])
            self._losses[m] = loss.detach()
            outs = [loss * self._scale + sum(extra)] if extra else [loss * self._scale]
        else:
            self._hand_off(a, Action(s + 1, "F", m), y)
            outs = [y] + extra
        self._stash[(s, m)] = (x, outs)

    def _backward(self, a: Action) -> None:
        s, m = a.stage, a.microbatch
        x, outs = self._stash[(s, m)]
        if s < self.n_stages - 1:
            grads = [self._take(a)] + [torch.ones_like(o) for o in outs[1:]]
        else:
            grads = [None]
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
        for t, a in enumerate(self.schedule[self.rank]):
            # Receives of step t go up before this rank's own step-t action, so a transfer
            # can start the moment its producer finishes instead of when this rank is done.
            self._post(t, "recv")
            if a is not None:
                # Inputs from other ranks are awaited before the clock starts: waiting is bubble.
                if a.kind == "F" and a.stage > 0 or a.kind == "B" and a.stage < last:
                    self._local[a] = self._take(a)
                start = self.clock()
                if a.kind == "F":
                    self._forward(a, inputs, targets)
                elif a.kind == "B":
                    self._backward(a)
                else:
                    self._weight(a)
                if self.device.type == "cuda":
                    torch.cuda.synchronize(self.device)
                self.spans.append(Span(self.rank, a, start, self.clock()))
            self._post(t, "send")
        for work in self._send_works:
            self._wait(work)
        leftovers = list(self._inbox) + list(self._local) + list(self._stash)
        if leftovers:
            raise RuntimeError(f"rank {self.rank} finished with unconsumed state {leftovers}")
        self._sent.clear()
        self._send_works.clear()
        self._waited.clear()
        if last not in self.stages:
            return None
        return [self._losses[m] for m in range(M)]

    def gather_spans(self) -> list[Span]:
        """All ranks' spans of the last step (a collective over the PP group)."""
        out: list[list[Span] | None] = [None] * dist.get_world_size(self.group)
        dist.all_gather_object(out, self.spans, group=self.group)
        return [s for spans in out for s in spans]
