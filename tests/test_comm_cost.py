"""The auto cost model against hand-computed cases, and calibration on real processes."""

from __future__ import annotations

import dataclasses
import importlib
import math
import time

import numpy as np
import pytest
import torch.distributed as dist
from hypothesis import given, settings
from hypothesis import strategies as st

from comm import (
    CostModel,
    Topology,
    calibrate,
    choose_algorithm,
    predict_flat,
    predict_halo,
    run_local,
)
from comm.cost import (
    METHODS,
    busiest_nic_bytes,
    decide_from_summaries,
    layout,
    predict,
    reference_predict_flat,
    reference_predict_halo,
    row_summary,
    summary_bracket,
    summary_width,
)
from comm.tools.calibrate import time_samples

# 1 row = 100 bytes; NICs move 1 row/s, local links 10 rows/s: numbers stay hand-checkable.
MODEL = CostModel(nic_bandwidth=100.0, local_bandwidth=1000.0, alpha_net=0.1,
                  alpha_local=0.01, halo_overhead_s=0.0)


def test_two_ranks_on_two_nodes() -> None:
    topo = Topology.uniform(2, 1)
    S = [[0, 4], [4, 0]]
    # Concurrent flat: 400 bytes through each NIC at 100 B/s + one message.
    assert predict_flat(S, 100, topo, MODEL) == pytest.approx(4.1)
    # Pairwise flat (gloo): the send and the receive of the one step serialise.
    pairwise = dataclasses.replace(MODEL, flat_pairwise=True)
    assert predict_flat(S, 100, topo, pairwise) == pytest.approx(8.2)
    # HALO: the relay into node 1 is rank 1 itself, so there is no phase III.
    assert predict_halo(S, 100, topo, MODEL) == pytest.approx(4.1)
    assert choose_algorithm(S, 100, topo, pairwise) == "halo"
    # A flat collective that reaches half the NIC rate (measured by `calibrate` on gloo).
    half = dataclasses.replace(MODEL, flat_nic_bandwidth=50.0)
    assert predict_flat(S, 100, topo, half) == pytest.approx(8.1)
    assert choose_algorithm(S, 100, topo, half) == "halo"
    assert choose_algorithm(S, 100, topo, dataclasses.replace(MODEL, flat_nic_bandwidth=200.0,
                                                               alpha_net=0.0)) == "flat"
    # gloo's collective exchanges a message with every peer, empty or not; HALO skips them.
    empty = [[0, 0], [0, 0]]
    assert predict_flat(empty, 100, topo, MODEL) == 0.0
    gloo_like = dataclasses.replace(MODEL, flat_empty_messages=True)
    assert predict_flat(empty, 100, topo, gloo_like) == pytest.approx(0.1)
    assert predict_halo(empty, 100, topo, gloo_like) == 0.0
    assert CostModel.for_backend("gloo").flat_empty_messages
    assert not CostModel.for_backend("nccl").flat_empty_messages


def test_two_by_two_counts_the_relay_hop() -> None:
    topo = Topology.uniform(2, 2)  # NIC = local index: ranks 0, 2 share rail 0
    S = [[1] * 4 for _ in range(4)]
    # flat: 2 remote rows per NIC (2 s) + 2 messages (0.2 s) + 1 local row (0.1 s + 0.01 s)
    assert predict_flat(S, 100, topo, MODEL) == pytest.approx(2.31)
    # halo: phase II 2 rows per NIC + 1 message = 2.1 s; phase III forwards 1 row to the
    # other local rank = 0.11 s; phase I (0.11 s) overlaps.
    assert predict_halo(S, 100, topo, MODEL) == pytest.approx(2.21)
    assert choose_algorithm(S, 100, topo, MODEL) == "halo"
    slow_halo = dataclasses.replace(MODEL, halo_overhead_s=0.5)
    assert choose_algorithm(S, 100, topo, slow_halo) == "flat"


def test_measured_corrections_steer_the_choice() -> None:
    topo = Topology.uniform(2, 2)
    S = [[1] * 4 for _ in range(4)]  # busiest NIC direction: 2 remote rows per rail = 200 B
    assert busiest_nic_bytes(S, 100, topo) == 200.0
    # Raw model: HALO 2.21 s < flat 2.31 s. Measured 10 % slower HALO, 5 % faster flat at
    # 100 B and neutral at 10 kB: log-interpolated at 200 B the factors are 1.085 / 0.9575,
    # so HALO 2.398 > flat 2.212.
    model = dataclasses.replace(MODEL, corrections=((100.0, 0.95, 1.1), (1e4, 1.0, 1.0)))
    assert model.correction(100.0) == pytest.approx((0.95, 1.1))
    assert model.correction(1e6) == pytest.approx((1.0, 1.0))  # held beyond the ends
    assert model.correction(200.0) == pytest.approx((0.95 + 0.05 * 0.5 * math.log10(2),
                                                     1.1 - 0.1 * 0.5 * math.log10(2)))
    assert choose_algorithm(S, 100, topo, MODEL) == "halo"
    assert choose_algorithm(S, 100, topo, model) == "flat"
    for bad in (((100.0, 1.0),), ((1e4, 1.0, 1.0), (100.0, 1.0, 1.0)), ((1e2, 1.0, 1.0), (1e2, 2.0, 1.0)), ((100.0, 0.0, 1.0),)):
        with pytest.raises(ValueError, match="corrections"):
            dataclasses.replace(MODEL, corrections=bad)


def test_single_node_is_always_flat() -> None:
    topo = Topology.uniform(1, 4)
    S = [[5] * 4 for _ in range(4)]
    assert choose_algorithm(S, 100, topo, dataclasses.replace(MODEL, alpha_local=10.0)) == "flat"


def test_model_validation_and_backend_defaults() -> None:
    with pytest.raises(ValueError, match="nic_bandwidth"):
        CostModel(nic_bandwidth=0.0)
    with pytest.raises(ValueError, match="alpha_net"):
        CostModel(alpha_net=-1.0)
    with pytest.raises(ValueError, match="flat_nic_bandwidth"):
        CostModel(flat_nic_bandwidth=0.0)
    assert CostModel.for_backend("gloo").flat_pairwise
    assert not CostModel.for_backend("nccl").flat_pairwise
    assert CostModel.for_backend("gloo", alpha_net=1.0).alpha_net == 1.0


def _calibrate_worker(rank: int, world: int, group: dist.ProcessGroup) -> dict:
    model = calibrate(group, Topology.uniform(2, 2), row_numel=64, large_rows=16, repeats=1,
                      max_rows=64, min_time_s=0.05)
    return dataclasses.asdict(model)


@pytest.mark.multiproc
def test_calibration_agrees_on_every_rank() -> None:
    models = run_local(_calibrate_worker, 4)
    assert all(m == models[0] for m in models)  # auto must decide identically everywhere
    m = models[0]
    # The fitted flat model is the concurrent one with its own measured NIC rate.
    assert not m["flat_pairwise"] and m["flat_nic_bandwidth"] > 0
    assert m["alpha_net"] > 0 and m["nic_bandwidth"] > 0
    assert m["halo_overhead_s"] >= 0
    # One correction per balanced exchange timed: 1 row, L = 16 (x4 up to 64), then 2L.
    sizes = [c[0] for c in m["corrections"]]
    assert len(sizes) >= 3 and sizes == sorted(sizes)
    assert all(c[1] > 0 and c[2] > 0 for c in m["corrections"])


def _sleep_arm(x) -> None:
    time.sleep(0.02)


def _timing_worker(rank: int, world: int, group: dist.ProcessGroup, start: str,
                   behind_s: float) -> tuple:
    if rank == 1 and behind_s:  # rank 1 reads a clock behind rank 0's, as on a second host
        # (comm.calibrate the module: the package exports the function of that name)
        importlib.import_module("comm.tools.calibrate")._clock = lambda: time.perf_counter() - behind_s
    spread: dict[str, list[float]] = {}
    try:
        samples = time_samples(group, Topology.uniform(2, 2), [[1] * 4 for _ in range(4)], 4,
                               {"sleep": _sleep_arm, "flat": "flat"}, repeats=4, warmup=1,
                               start=start, start_spread=spread)
    except RuntimeError as e:
        return str(e), None
    return samples, spread


@pytest.mark.multiproc
@pytest.mark.parametrize("start", ["clock", "barrier"])
def test_repeats_are_timed_from_the_start_every_rank_shares(start: str) -> None:
    results = run_local(_timing_worker, 4, start, 0.0)
    assert all(r == results[0] for r in results)  # all-reduced: every rank stops together
    samples, spread = results[0]
    assert set(samples) == {"sleep", "flat"} and all(len(v) == 4 for v in samples.values())
    # Every rank sleeps 20 ms after the common start, so no repeat can be shorter.
    assert min(samples["sleep"]) >= 0.02 and min(samples["flat"]) > 0
    assert all(len(spread[a]) == 4 and min(spread[a]) >= 0 for a in samples)


@pytest.mark.multiproc
def test_clock_start_refuses_ranks_on_different_clocks() -> None:
    results = run_local(_timing_worker, 2, "clock", 100.0)
    for message, spread in results:  # every rank raises, none hangs in the exchange
        assert spread is None and "one host's clock" in message


def test_time_samples_rejects_an_unknown_start() -> None:
    with pytest.raises(ValueError, match="start must be one of .*'clock'.* got 'gun'"):
        time_samples(None, Topology.uniform(1, 2), [[1, 1], [1, 1]], 4, {"flat": "flat"},
                     start="gun")


def _topology_and_splits(nodes: int, gpus: int, nic_shift: int, values: list[int],
                         zero_p: float, salt: int) -> tuple[Topology, list[list[int]]]:
    """A uniform topology with gpus >> nic_shift NICs per node (rounded to a divisor) and a
    split matrix from `values`, with about a zero_p share of its entries zero."""
    nics = max(1, gpus >> nic_shift)
    while gpus % nics:
        nics -= 1
    topo = Topology.uniform(nodes, gpus, nics_per_node=nics)
    R = topo.world_size
    S = [[values[(s * R + d) % 256] if (s * salt + d * 3) % 10 >= zero_p * 10 else 0
          for d in range(R)] for s in range(R)]
    return topo, S


@settings(max_examples=60, deadline=None)
@given(
    st.integers(1, 4), st.integers(1, 4), st.integers(0, 2), st.booleans(),
    st.lists(st.integers(0, 5), min_size=256, max_size=256), st.floats(0.0, 0.9),
    st.booleans(),
)
def test_every_implementation_matches_the_loops(nodes: int, gpus: int, nic_shift: int,
                                                pairwise: bool, values: list[int],
                                                zero_p: float, empty_messages: bool) -> None:
    """Each implementation behind `predict` against the plain-loop definition ("loops"),
    on lists and on an integer array. Tolerance: the same float terms summed in another order
    (numpy's pairwise sums, per-NIC tables) differ from the loops' running sums by a few ulp;
    the byte counts themselves are integers, exact in float64."""
    topo, S = _topology_and_splits(nodes, gpus, nic_shift, values, zero_p, 7)
    model = dataclasses.replace(MODEL, flat_pairwise=pairwise, halo_overhead_s=0.3,
                                flat_nic_bandwidth=None if pairwise else 70.0,
                                flat_empty_messages=empty_messages)
    ref = predict(S, 64, topo, model, method="loops")
    assert ref == (reference_predict_flat(S, 64, topo, model),
                   reference_predict_halo(S, 64, topo, model), ref.busiest)
    usable = [m for m in METHODS if m != "loops"
              and not (pairwise and m in ("one-pass", "blocked"))
              and not (m == "blocked" and layout(topo).blocked is None)]
    assert "vectorised" in usable and ("one-pass" in usable) == (not pairwise)
    for method in usable:
        for M in (S, np.asarray(S, dtype=np.int64)):
            got = predict(M, 64, topo, model, method=method)
            assert tuple(got) == pytest.approx(tuple(ref), rel=1e-12), method
    assert predict_flat(S, 64, topo, model) == pytest.approx(ref.flat, rel=1e-12)
    assert predict_halo(S, 64, topo, model) == pytest.approx(ref.halo, rel=1e-12)
    assert busiest_nic_bytes(S, 64, topo) == ref.busiest


def test_predict_refuses_what_an_implementation_cannot_model() -> None:
    topo = Topology.uniform(2, 2)
    S = [[1] * 4 for _ in range(4)]
    with pytest.raises(ValueError, match="method must be one of auto, loops, one-pass, "
                                         "vectorised, blocked, got 'fast'"):
        predict(S, 64, topo, MODEL, method="fast")
    pairwise = dataclasses.replace(MODEL, flat_pairwise=True)
    for method in ("one-pass", "blocked"):
        with pytest.raises(ValueError, match=f"method='{method}' models the concurrent flat"):
            predict(S, 64, topo, pairwise, method=method)
    odd = Topology.uniform(2, 2).restrict([0, 1, 2])  # nodes of 2 and 1 ranks
    with pytest.raises(ValueError, match="method='blocked' needs a node-major topology"):
        predict([[1] * 3 for _ in range(3)], 64, odd, MODEL, method="blocked")


@settings(max_examples=80, deadline=None)
@given(
    st.integers(2, 5), st.integers(1, 4), st.integers(0, 2),
    st.lists(st.integers(0, 40), min_size=256, max_size=256), st.floats(0.0, 0.9),
    st.floats(1e-4, 0.2), st.floats(0.0, 1.0), st.floats(0.5, 2.0), st.booleans(),
)
def test_row_summaries_bracket_the_model(nodes: int, gpus: int, nic_shift: int,
                                         values: list[int], zero_p: float, alpha: float,
                                         overhead: float, halo_factor: float,
                                         empty_messages: bool) -> None:
    """auto's first round: summaries of single rows give flat and the busiest NIC exactly,
    bracket HALO, and whatever they decide is `choose_algorithm`'s decision."""
    topo, S = _topology_and_splits(nodes, gpus, nic_shift, values, zero_p, 5)
    R = topo.world_size
    model = dataclasses.replace(MODEL, alpha_net=alpha, alpha_local=alpha / 3,
                                halo_overhead_s=overhead, flat_nic_bandwidth=80.0,
                                flat_empty_messages=empty_messages,
                                corrections=((100.0, 1.0, halo_factor), (1e4, 1.1, 0.9)))
    width = summary_width(topo)
    packed = []  # what every rank receives: (row, summary of the row) from every source
    for s in range(R):
        summary = row_summary(S[s], s, topo)
        assert len(summary) == width
        packed += S[s] + summary
    flat, low, high, busiest = summary_bracket(packed, R, width + R, 64, topo, model)
    exact_flat, exact_halo, exact_busiest = predict(S, 64, topo, model, method="one-pass")
    assert flat == exact_flat and busiest == exact_busiest == busiest_nic_bytes(S, 64, topo)
    assert low <= exact_halo <= high
    decided = decide_from_summaries(packed, R, width + R, 64, topo, model)
    assert decided in (None, choose_algorithm(S, 64, topo, model))


def test_summaries_decide_the_usual_exchanges() -> None:
    """The bracket is narrow enough to decide a balanced exchange either way (no gather)."""
    topo = Topology.uniform(8, 2, nics_per_node=1)
    model = CostModel(nic_bandwidth=12.5e6, local_bandwidth=150e6, alpha_net=2e-3,
                      alpha_local=2e-3, halo_overhead_s=20e-3, flat_nic_bandwidth=10e6)
    width = summary_width(topo)
    for rows, expect in ((1, "flat"), (4096, "halo")):
        S = [[rows] * 16 for _ in range(16)]
        packed = sum((S[s] + row_summary(S[s], s, topo) for s in range(16)), [])
        assert choose_algorithm(S, 1024, topo, model) == expect
        assert decide_from_summaries(packed, 16, width + 16, 1024, topo, model) == expect


def test_summaries_refuse_the_pairwise_model() -> None:
    topo = Topology.uniform(2, 1)
    with pytest.raises(ValueError, match="flat_pairwise"):
        decide_from_summaries([0] * 20, 1, 10, 4, topo, dataclasses.replace(
            MODEL, flat_pairwise=True))
