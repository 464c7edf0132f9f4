"""Calibrate `CostModel` on the running job: a few timed exchanges, one agreed result.

Collective: every rank of `group` calls it with the same arguments. It times flat and HALO
alternating inside each repeat, in an order that rotates from repeat to repeat (on a loaded
host an exchange measured up to 20 % faster or slower depending on which one ran just
before), takes the median of the repeats after a warm-up and the maximum over ranks (the
slowest rank ends the collective). Balanced exchanges are timed with one row per rank pair
(fixed costs dominate; `small_repeats` of them, they are cheap) and with L rows, L growing
x4 from `large_rows` until one exchange takes >= 5x the one-row time, then 2L (bandwidth
dominates). Every rank fits the same numbers, so the returned model is identical everywhere
and `algorithm="auto"` stays deadlock-free:
    alpha_net = alpha_local  flat small time / (R - 1) messages (all peers at once)
    local_bandwidth          intra-node bytes per rank of L rows / (flat time of an
                             intra-node-only exchange of 2L rows - of L rows)
    halo_overhead_s          HALO small time - HALO small prediction without overhead
    nic_bandwidth            busiest-NIC bytes of L rows / (HALO(2L) - HALO(L) - the
                             predicted relay hop of L rows)
    flat_nic_bandwidth       busiest-NIC bytes of L rows / (flat(2L) - flat(L) - the
                             intra-node part of L rows)
    corrections              measured / fitted-model time of each algorithm at every
                             balanced exchange timed (see `CostModel.corrections`)
The fitted model is the concurrent flat model (flat_pairwise=False): the two algorithms
then differ in fixed costs, in the NIC rate each reaches and in HALO's relay hop, all
measured on the machine at hand; the corrections hold what those few numbers miss.
"""

from __future__ import annotations

import dataclasses
import functools
import statistics
import time
from collections import deque
from collections.abc import Callable

import torch
import torch.distributed as dist

from comm.collectives.alltoall import all_to_all
from comm.cost import CostModel, busiest_nic_bytes, predict_flat, predict_halo
from comm.topology import Topology

__all__ = [
    "START_MODES", "arm_orders", "calibrate", "time_algorithms", "time_all_to_all",
    "time_samples",
]


def arm_orders(arms: tuple[str, ...]) -> list[tuple[str, ...]]:
    """Every rotation of the arms and of their reverse (duplicates dropped): run in turn,
    each arm takes every position equally often and follows each other arm (for two arms
    the two orders, for three all six)."""
    back = arms[::-1]
    return list(dict.fromkeys([arms[k:] + arms[:k] for k in range(len(arms))]
                              + [back[k:] + back[:k] for k in range(len(arms))]))


START_MODES = ("barrier", "clock")
_clock = time.perf_counter  # one host's monotonic clock; tests swap it to fake a second host


def _latest_clock(group: dist.ProcessGroup | None) -> float:
    """The ranks' clocks, all-reduced (max): when the last rank arrived."""
    t = torch.tensor([_clock()], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return t.item()


def _check_shared_clock(group: dist.ProcessGroup | None) -> None:
    """Raise on every rank unless all ranks read one clock. After an all-reduce (max) of the
    ranks' clocks, none can read less than that maximum if the clock is shared; ranks on
    separate hosts (clocks apart by more than the all-reduce's latency) fail this."""
    latest = _latest_clock(group)
    ok = torch.tensor([float(_clock() >= latest)], dtype=torch.float64)
    dist.all_reduce(ok, op=dist.ReduceOp.MIN, group=group)
    if ok.item() != 1.0:
        raise RuntimeError("start='clock' needs every rank on one host's clock (as on the "
                           "namespace emulator, comm.emulate); these ranks' clocks differ: "
                           "use start='barrier'")


def _release(group: dist.ProcessGroup | None, margin_s: float) -> tuple[float, float]:
    """start='clock': agree on a start time `margin_s` after the last rank arrived (an
    all-reduce of the ranks' clocks, max) and sleep until it. Returns (start, delay): how long
    after the last arrival this rank left the all-reduce."""
    latest = _latest_clock(group)
    now = _clock()
    start = latest + margin_s
    if start > now:
        time.sleep(start - now)
    return start, now - latest


def time_samples(
    group: dist.ProcessGroup | None,
    topo: Topology,
    S: list[list[int]],
    row_numel: int,
    arms: dict[str, str | Callable[[torch.Tensor], object]],
    repeats: int = 3,
    warmup: int = 1,
    model: CostModel | None = None,
    min_time_s: float = 0.0,
    max_repeats: int = 0,
    whole_cycles: bool = False,
    start: str = "barrier",
    start_spread: dict[str, list[float]] | None = None,
) -> dict[str, list[float]]:
    """The slowest rank's time (seconds) of each timed repeat of one exchange of S, per arm
    (label -> algorithm, or a function called with this rank's rows that runs the exchange
    its own way; two labels may run the same algorithm, as a control).

    The arms alternate inside each repeat, going through `arm_orders` from repeat to
    repeat: on a loaded host an exchange measured up to 20 % faster or slower depending on
    which one ran just before. At least `repeats`; then more (up to `max_repeats`) until
    each arm has run `min_time_s` in total: cheap exchanges get the samples their noise
    needs. `whole_cycles` stops only after a whole round of orders. Every rank sees the same
    all-reduced times, so all stop after the same repeat.

    `start` says when a repeat begins. "barrier": each rank times from its own exit of a
    barrier, so the spread of the exits (5-15 ms with 16 ranks on 2 cores) counts against
    the exchange. "clock" (ranks on one host's clock only, checked): all ranks are released
    at one agreed time on that clock and time from it, a rank released late included; the
    agreed time lies twice the recent release delay after the last rank arrived (1-50 ms).
    `start_spread`, if given, gets per arm the spread of the ranks' start (seconds, last
    minus first) of every timed repeat.
    """
    if start not in START_MODES:
        raise ValueError(f"start must be one of {START_MODES}, got {start!r}")
    if start == "clock":
        _check_shared_clock(group)
    rank = dist.get_rank(group)
    x = torch.randn(sum(S[rank]), row_numel)
    cycle = arm_orders(tuple(arms))
    samples: dict[str, list[float]] = {a: [] for a in arms}
    spreads: dict[str, list[float]] = {a: [] for a in arms}
    delays = deque([0.005], maxlen=16)  # recent release delays after the last arrival (s)
    i = 0
    while True:
        for arm in cycle[i % len(cycle)]:
            if start == "clock":
                t0, delay = _release(group, min(0.05, max(0.001, 2 * max(delays))))
                began = _clock()
            else:
                dist.barrier(group)
                t0 = began = _clock()
                delay = 0.0
            run = arms[arm]
            if callable(run):
                run(x)
            else:
                all_to_all(x, S[rank], group, run, topology=topo, cost_model=model)
            stats = torch.tensor([_clock() - t0, began, -began, delay], dtype=torch.float64)
            dist.all_reduce(stats, op=dist.ReduceOp.MAX, group=group)
            delays.append(float(stats[3]))
            if i >= warmup:
                samples[arm].append(float(stats[0]))
                spreads[arm].append(float(stats[1] + stats[2]))
        i += 1
        done = i - warmup
        if done >= repeats and (not whole_cycles or done % len(cycle) == 0) and (
                done >= max_repeats or min(sum(v) for v in samples.values()) >= min_time_s):
            if start_spread is not None:
                start_spread.update(spreads)
            return samples


def time_algorithms(
    group: dist.ProcessGroup | None,
    topo: Topology,
    S: list[list[int]],
    row_numel: int,
    algorithms: tuple[str, ...] = ("flat", "halo"),
    repeats: int = 3,
    warmup: int = 1,
    model: CostModel | None = None,
    min_time_s: float = 0.0,
    max_repeats: int = 0,
) -> dict[str, float]:
    """Median of `time_samples` per algorithm (seconds)."""
    samples = time_samples(group, topo, S, row_numel, {a: a for a in algorithms}, repeats,
                           warmup, model, min_time_s, max_repeats)
    return {a: statistics.median(v) for a, v in samples.items()}


def time_all_to_all(
    group: dist.ProcessGroup | None,
    topo: Topology,
    S: list[list[int]],
    row_numel: int,
    algorithm: str,
    repeats: int = 3,
    warmup: int = 1,
    model: CostModel | None = None,
) -> float:
    """Median over repeats of the slowest rank's time for one exchange of S (seconds)."""
    return time_algorithms(group, topo, S, row_numel, (algorithm,), repeats, warmup,
                           model)[algorithm]


def _uniform(R: int, rows: int) -> list[list[int]]:
    return [[rows] * R for _ in range(R)]


def calibrate(
    group: dist.ProcessGroup | None,
    topo: Topology,
    row_numel: int = 256,
    large_rows: int = 64,
    repeats: int = 3,
    base: CostModel | None = None,
    max_rows: int = 16384,
    small_repeats: int = 15,
    min_time_s: float = 1.5,
    max_repeats: int = 400,
) -> CostModel:
    """Fit alpha, HALO overhead, local and NIC bandwidth of `base` (default: the backend's
    flags on placeholder rates) and the per-size corrections. The model's `source` says it
    was calibrated, and names any rate no measurement could fit (kept from `base`).

    Bandwidths come from the time difference between L and 2L rows per pair, with L grown
    (x4 from `large_rows`, at most `max_rows`) until one exchange takes >= 5x the one-row
    time: fixed costs cancel and noise on a loaded machine cannot make the difference
    vanish. A fit that still comes out non-positive keeps `base`'s value. Every timed size
    repeats until each algorithm ran `min_time_s` (at least `repeats`, the one-row exchange
    `small_repeats`, times; at most `max_repeats`).
    """
    R = dist.get_world_size(group)
    if topo.world_size != R:
        raise ValueError(f"topology has {topo.world_size} ranks, the group {R}")
    if large_rows < 1 or row_numel < 1 or max_rows < large_rows:
        raise ValueError(f"need 1 <= large_rows={large_rows} <= max_rows={max_rows} and "
                         f"row_numel={row_numel} >= 1")
    if repeats < 1 or small_repeats < 1 or min_time_s < 0:
        raise ValueError(f"repeats={repeats} and small_repeats={small_repeats} must be >= 1, "
                         f"min_time_s={min_time_s} >= 0")
    base = base or CostModel.for_backend(dist.get_backend(group))
    # The fitted flat model is the concurrent one (what gloo's all_to_all_single and NCCL
    # post: every peer at once); gloo's partial serialisation of pair directions shows up
    # in the fitted flat_nic_bandwidth instead of a pessimistic pairwise schedule.
    base = dataclasses.replace(base, flat_pairwise=False, flat_nic_bandwidth=None,
                               corrections=(), source=f"calibration on {R} ranks, "
                               f"{topo.num_nodes} nodes ({dist.get_backend(group)})")
    row_bytes = 4 * row_numel  # float32 rows
    small = _uniform(R, 1)
    if topo.num_nodes == 1:
        flat_small = time_all_to_all(group, topo, small, row_numel, "flat", small_repeats)
        return dataclasses.replace(base, alpha_net=flat_small / max(1, R - 1),
                                   alpha_local=flat_small / max(1, R - 1))
    # Exchanges repeat until each algorithm ran `min_time_s` (at most max_repeats): gloo's
    # flat collective is bimodal from repeat to repeat (see CostModel.flat_nic_bandwidth),
    # and with 0.5 s (3-4 repeats of a 1 MB per pair exchange at 4x2 @ 1 Gbit/s) the fitted
    # flat rate came out up to 18 % off and `auto` ran flat where HALO was 6-17 % faster. A
    # 12 ms exchange of 8 ranks on 2 cores spreads over +-40 %: 15 repeats of the one-row
    # exchange once made `auto` pick HALO where it was 13 % slower.
    timed = functools.partial(time_algorithms, min_time_s=min_time_s,
                              max_repeats=max(repeats, small_repeats, max_repeats))
    measured = {1: timed(group, topo, small, row_numel, repeats=small_repeats)}
    alpha = measured[1]["flat"] / (R - 1)
    fitted = dataclasses.replace(base, alpha_net=alpha, alpha_local=alpha, halo_overhead_s=0.0)

    rows = large_rows
    measured[rows] = timed(group, topo, _uniform(R, rows), row_numel, repeats=repeats)
    while measured[rows]["halo"] < 5 * measured[1]["halo"] and rows * 4 <= max_rows:
        rows *= 4
        measured[rows] = timed(group, topo, _uniform(R, rows), row_numel, repeats=repeats)
    measured[2 * rows] = timed(group, topo, _uniform(R, 2 * rows), row_numel, repeats=repeats)
    t_a, t_b = measured[rows]["halo"], measured[2 * rows]["halo"]
    f_a, f_b = measured[rows]["flat"], measured[2 * rows]["flat"]

    G = max(topo.ranks_per_node())
    local_s = 0.0  # seconds the intra-node rows of L more rows per pair add to flat
    if G > 1:
        # Intra-node rows only: what HALO's phase III costs per byte. On 2 shared cores the
        # loopback TCP hop is far slower than the 1 GB/s default and decides flat vs HALO.
        node = topo.rank2node
        local = [[1 if node[s] == node[d] else 0 for d in range(R)] for s in range(R)]
        l_a, l_b = (timed(group, topo, [[v * n for v in r] for r in local],
                          row_numel, ("flat",), repeats)["flat"]
                    for n in (rows, 2 * rows))
        per_rank = (G - 1) * rows * row_bytes
        if l_b > l_a:
            fitted = dataclasses.replace(fitted, local_bandwidth=per_rank / (l_b - l_a))
            local_s = l_b - l_a
    overhead = max(0.0, measured[1]["halo"] - predict_halo(small, row_bytes, topo, fitted))
    # HALO(2L) - HALO(L) = NIC time of L rows + relay hop of L rows: strip the fitted hop.
    no_nic = dataclasses.replace(fitted, nic_bandwidth=1e30)
    hop = (predict_halo(_uniform(R, 2 * rows), row_bytes, topo, no_nic)
           - predict_halo(_uniform(R, rows), row_bytes, topo, no_nic))
    busiest = busiest_nic_bytes(_uniform(R, rows), row_bytes, topo)
    bandwidth = base.nic_bandwidth
    kept = [] if local_s else ["local_bandwidth"]  # what no measurement could fit
    if t_b - t_a - hop > 0:
        bandwidth = busiest / (t_b - t_a - hop)
    else:
        kept.append("nic_bandwidth")
    # flat(2L) - flat(L) = NIC time of L rows at the flat rate + their intra-node share.
    flat_bw = bandwidth
    if f_b - f_a - local_s > 0:
        flat_bw = busiest / (f_b - f_a - local_s)
    fitted = dataclasses.replace(fitted, halo_overhead_s=overhead, nic_bandwidth=bandwidth,
                                 flat_nic_bandwidth=flat_bw)
    if kept:
        fitted = dataclasses.replace(fitted, source=f"{fitted.source}; {', '.join(kept)} "
                                     f"not measurable, kept from {base.source}")
    corrections = []
    for n, t in sorted(measured.items()):
        S = _uniform(R, n)
        corrections.append((busiest_nic_bytes(S, row_bytes, topo),
                            t["flat"] / predict_flat(S, row_bytes, topo, fitted),
                            t["halo"] / predict_halo(S, row_bytes, topo, fitted)))
    return dataclasses.replace(fitted, corrections=tuple(corrections))
