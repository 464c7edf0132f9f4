"""`auto`'s trial: the run's own MoE layer timed under each all-to-all choice `auto` hesitates
between, on the run's links, before training starts (issue 26: `auto` picks dedup and overlap
where they win).

Why measure: whether dedup or the layer pipeline pays depends on more than bytes. On the
namespace emulator, EP over 4 nodes at top-4 sends 0.71x flat's rows with dedup; at 200 Mbit/s
the step ran 0.82x flat's, at 1 Gbit/s 1.07x (8 processes on 2 cores: the relay hop and the
chunks' host work cost more than the link saves), and the layer pipeline that hid 13-25 % of
the step on 2 nodes x 2 ranks lost 5 % on 4 x 2 (docs/alltoall.md). A byte bound or a rule
cannot see either; one MoE layer's forward and backward, timed on every rank at once, does.

What is timed: a stand-alone MoE layer of the run's model config (its own weights, drawn
normal(0, init_std); the model itself is untouched), its experts sharded over the run's EP
group like the model's (`parallelize`'s dispatcher, redundant slots included), fed one
micro-batch of random activations, forward and backward under the run's autocast. Every
candidate (algorithm x overlap) runs once to warm up, then `repeats` rounds, the candidates
interleaved within each round so that drift hits them alike; a candidate's time is the
slowest rank's median (the step waits for it). Every rank takes part (each stage's EP group
times its own copy of the layer), so the pick is one for the whole run.

Cost: (1 + repeats) x candidates forward + backward passes of one MoE layer, and its local
experts' weights for the duration (freed after). `--comm.auto_trial=0` skips the trial:
`auto` then decides by its rules alone (`trainer.build.resolve_a2a`).
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

__all__ = ["Candidate", "TrialResult", "pick", "run_trial"]

# (algorithm, overlap, chunks) of the EP dispatcher
Candidate = tuple[str, str, int]


@dataclass(frozen=True)
class TrialResult:
    """Seconds of one MoE layer's forward + backward per candidate (the slowest rank's median
    over the rounds), and the rounds and tokens they came from."""

    seconds: dict[Candidate, float]
    repeats: int
    tokens: int

    def describe(self) -> str:
        """The candidates' times, fastest first, for the log."""
        best = min(self.seconds.values())
        return ", ".join(f"{label(c)} {1e3 * s:.1f} ms ({s / best:.2f}x)"
                         for c, s in sorted(self.seconds.items(), key=lambda kv: kv[1]))


def label(c: Candidate) -> str:
    """algorithm/overlap[/chunks], as the benchmarks name their arms."""
    algo, overlap, chunks = c
    return f"{algo}/{overlap}" + (f"/{chunks}" if overlap != "none" else "")


def pick(result: TrialResult) -> Candidate:
    """The fastest candidate; ties go to the first listed (the rules' own choice comes first)."""
    return min(result.seconds, key=lambda c: result.seconds[c])


def run_trial(cfg: Any, mcfg: Any, mesh: Any, topo: Any, cost_model: Any,
              candidates: list[Candidate], device: torch.device, autocast_ctx: Any,
              repeats: int) -> TrialResult:
    """Time one stand-alone MoE layer under each candidate (module docstring). Collective
    over every rank, in the same order on each: the EP group's exchanges, then one
    all_reduce (MAX) of the per-rank medians over the world."""
    from model.moe import MoELayer

    from .distributed.parallel import shard_layer
    from .distributed.replicas import initial_slot_map

    if repeats < 1 or len(candidates) < 2:
        raise ValueError(f"a trial needs repeats >= 1 and >= 2 candidates; got repeats="
                         f"{repeats}, candidates {candidates}")
    from comm.ep import EPDispatcher

    with torch.device("meta"):
        layer = MoELayer(mcfg)
    if cfg.balance.redundant:
        layer.resize_slots(initial_slot_map(layer.num_experts, mesh.ep, cfg.balance.redundant))
    algo, overlap, chunks = candidates[0]
    disp = EPDispatcher(mesh.ep_group, mesh.ep, layer.n_slots, algo, topo,
                        cost_model, overlap, chunks)
    shard_layer(layer, disp, mesh.ep_idx)
    layer.to_empty(device=device)
    gen = torch.Generator(device=device).manual_seed(cfg.train.seed + 7919 * mesh.rank)
    with torch.no_grad():
        for p in layer.parameters():
            p.normal_(0.0, mcfg.init_std, generator=gen)
    layer.reset_state()  # identity placement, zero router bias (to_empty left them unset)
    if cfg.debug.skew:  # the run's benchmark knob: route as the run will
        E = layer.num_experts
        layer.router.e_score_correction_bias.copy_(
            -cfg.debug.skew * torch.log1p(torch.arange(E, dtype=torch.float32)))
    par, t = cfg.parallel, cfg.train
    batch = max(1, t.global_batch // mesh.n_data_shards // par.microbatches)
    x = torch.randn(batch, t.seq_len, mcfg.d_model, device=device, generator=gen)
    grad = torch.randn(x.shape, device=device, generator=gen)
    times: dict[Candidate, list[float]] = {c: [] for c in candidates}

    def once(c: Candidate) -> float:
        disp.algorithm, disp.overlap, disp.chunks = c
        xi = x.detach().requires_grad_(True)
        t0 = time.perf_counter()
        with autocast_ctx:
            y = layer(xi)
        y.backward(grad.to(y.dtype))
        if device.type == "cuda":  # every exchange of this pass has completed on the host side
            torch.cuda.synchronize(device)
        return time.perf_counter() - t0

    for c in candidates:  # warm-up: first-call allocations, the cost model's caches
        once(c)
    for _ in range(repeats):
        for c in candidates:
            times[c].append(once(c))
    disp.take_stats()
    med = torch.tensor([statistics.median(times[c]) for c in candidates], dtype=torch.float64)
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        red = med.to(device) if dist.get_backend() == "nccl" else med
        dist.all_reduce(red, op=dist.ReduceOp.MAX)
        med = red.cpu()
    return TrialResult({c: float(s) for c, s in zip(candidates, med.tolist(), strict=True)},
                       repeats, batch * t.seq_len)
