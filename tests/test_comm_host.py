"""The per-call host path of HALO and auto (vectorised planning, plans built once) against the
plain definitions, and where `auto`'s cost model comes from (platform files, no default)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed as dist
from conftest import value_errors
from hypothesis import given, settings
from hypothesis import strategies as st

from comm import CostModel, Topology, all_to_all, plan_all_to_all, run_local
from comm.collectives.alltoall import settle_plan
from comm.collectives.halo_plan import SplitPlans, halo_plan, transpose
from comm.cost import (
    PLATFORM_DIR,
    busiest_nic_bytes,
    choose_algorithm,
    layout,
    predict,
    reference_predict_flat,
    reference_predict_halo,
    row_summary,
)
from comm.cost.blocked import blocked_terms

MODEL = CostModel(nic_bandwidth=100.0, local_bandwidth=1000.0, alpha_net=0.1,
                  alpha_local=0.01, halo_overhead_s=0.3, flat_nic_bandwidth=70.0)


@settings(max_examples=60, deadline=None)
@given(st.integers(2, 5), st.integers(1, 5), st.integers(0, 2), st.floats(0.0, 0.95),
       st.booleans(), st.sampled_from([np.int32, np.int64]), st.integers(0, 2**16))
def test_blocked_predictions_equal_the_loops(nodes: int, gpus: int, nic_shift: int,
                                             zero_p: float, empty: bool, dtype: type,
                                             seed: int) -> None:
    """`predict(method="blocked")` (what auto runs beyond 32 ranks) equals the plain-loop model, on
    the matrix and on its transposed view (the mirrored exchange), int32 and int64."""
    nics = max(1, gpus >> nic_shift)
    while gpus % nics:
        nics -= 1
    topo = Topology.uniform(nodes, gpus, nics_per_node=nics)
    R = topo.world_size
    rng = np.random.default_rng(seed)
    S = rng.integers(0, 7, (R, R)).astype(dtype)
    S[rng.random((R, R)) < zero_p] = 0
    model = dataclasses.replace(MODEL, flat_empty_messages=empty)
    for M in (S, S.T):
        rows = M.tolist()
        flat, halo, busiest = predict(M, 64, topo, model, method="blocked")
        assert flat == pytest.approx(reference_predict_flat(rows, 64, topo, model))
        assert halo == pytest.approx(reference_predict_halo(rows, 64, topo, model))
        assert busiest == busiest_nic_bytes(rows, 64, topo)
        loops = predict(rows, 64, topo, model, method="one-pass")
        assert (flat, halo) == pytest.approx(loops[:2])


@settings(max_examples=40, deadline=None)
@given(st.integers(5, 8), st.sampled_from([1, 2, 8]), st.floats(0.0, 0.9),
       st.sampled_from([-1.0, -0.5, 0.0, 0.5, 1.0, 2.0]), st.booleans(),
       st.integers(0, 2**16))
def test_decision_with_the_relay_bracket_is_the_exact_one(nodes: int, nics: int,
                                                         zero_p: float, where: float,
                                                         corrected: bool, seed: int) -> None:
    """Beyond 32 ranks `choose_algorithm` counts HALO's relay fan-out only where the answer
    hinges on it (HALO's bounds straddle flat); its decision is the exact model's anyway.
    The HALO overhead is set so that flat lies below, inside or above the bracket."""
    topo = Topology.uniform(nodes, 8, nics_per_node=nics)
    R = topo.world_size
    rng = np.random.default_rng(seed)
    S = rng.integers(0, 50, (R, R))
    S[rng.random((R, R)) < zero_p] = 0
    base = dataclasses.replace(MODEL, alpha_local=0.5, halo_overhead_s=0.0, corrections=(
        (1e3, 1.1, 0.9), (1e6, 0.8, 1.2)) if corrected else ())
    L = layout(topo)
    for M in (S, S.T):
        t = blocked_terms(M, 64, L, base)
        low, high = t.halo_bounds(8)
        exact = t.halo(t.relay_peers())
        assert low <= exact <= high
        c_flat, c_halo = base.correction(t.busiest)
        # overhead placing flat at `where` in the bracket (0: low, 1: high; outside beyond)
        target = t.flat * c_flat / c_halo - (low + where * (high - low))
        model = dataclasses.replace(base, halo_overhead_s=max(0.0, target))
        _, halo, _ = predict(M, 64, topo, model, method="blocked")
        flat = t.flat
        want = "halo" if halo * c_halo < flat * c_flat else "flat"
        assert choose_algorithm(M, 64, topo, model) == want
        assert halo == pytest.approx(reference_predict_halo(M.tolist(), 64, topo, model))


def test_model_reads_the_matrix_where_the_exchange_left_it() -> None:
    """A row-strided view of the exchanged ints (payload and summaries between the rows)
    and its transpose give the predictions of the contiguous matrix."""
    topo = Topology.uniform(6, 8, nics_per_node=2)
    rng = np.random.default_rng(5)
    S = rng.integers(0, 9, (48, 48))
    for dtype in (np.int32, np.int64):
        values = np.zeros((48, 3 + 48 + 11), dtype=dtype)
        values[:, 3:51] = S
        view = values[:, 3:51]
        assert not view.flags.c_contiguous
        for M, want in ((view, S), (view.T, S.T)):
            got = predict(M, 64, topo, MODEL, method="blocked")
            assert got == predict(np.ascontiguousarray(want), 64, topo, MODEL, method="blocked")
            assert choose_algorithm(M, 64, topo, MODEL) == choose_algorithm(want.tolist(), 64,
                                                                             topo, MODEL)


def test_choose_algorithm_reads_arrays_and_lists_alike() -> None:
    """Beyond 32 ranks the array path decides as the general vectorised model on lists,
    for a matrix and for its transposed view."""
    topo = Topology.uniform(6, 8, nics_per_node=2)
    model = CostModel(nic_bandwidth=1e5, local_bandwidth=5e4, alpha_net=1.0, alpha_local=0.01,
                      halo_overhead_s=0.3)  # per-message cost or the relay hop decides
    rng = np.random.default_rng(3)
    decided = set()
    for scale in (1, 30, 3000):
        S = rng.integers(0, 4, (48, 48)) * scale
        for M in (S, S.T):
            p = predict(M.tolist(), 64, topo, model, method="vectorised")
            want = "halo" if p.halo < p.flat else "flat"
            assert choose_algorithm(M, 64, topo, model) == want
            decided.add(want)
    assert decided == {"flat", "halo"}  # the cases exercise both answers


def test_split_plans_build_each_rank_plan_once_and_share_the_transpose() -> None:
    topo = Topology.uniform(3, 4, nics_per_node=2)
    rng = np.random.default_rng(0)
    S = rng.integers(0, 5, (12, 12))
    S[2] = 0
    splits = SplitPlans(S.tolist(), topo)
    want, want_t = halo_plan(S.tolist(), topo), halo_plan(transpose(S.tolist()), topo)
    for r in range(12):
        assert splits.rank_plan(r) == want[r]
        assert splits.rank_plan(r) is splits.rank_plan(r)  # cached
        assert splits.transposed().rank_plan(r) == want_t[r]
    assert splits.transposed().transposed() is splits
    assert not splits.matrix.flags.writeable
    S[0, 0] = 99  # the caller's array is copied, not frozen or aliased
    assert splits.matrix[0, 0] != 99
    with pytest.raises(ValueError, match="integers"):
        SplitPlans([[0.5] * 12] * 12, topo)
    with pytest.raises(ValueError, match="rank 12 out of range"):
        splits.rank_plan(12)


@pytest.mark.parametrize("algorithm", ["halo", "auto"])
def test_settle_plan_from_exchanged_ints(algorithm: str) -> None:
    """settle_plan (the pure step after the small exchange) on the ints every rank would
    receive: payload, out_splits and the decision of both directions as the lists give."""
    topo = Topology.uniform(5, 8, nics_per_node=1)
    R, k, rank = 40, 2, 9
    rng = np.random.default_rng(1)
    S = (rng.integers(0, 3, (R, R)) * rng.integers(0, 200, (R, 1))).tolist()
    model = dataclasses.replace(MODEL, alpha_net=0.5) if algorithm == "auto" else None
    parts = []
    for s in range(R):
        tail = row_summary(S[s], s, topo) if algorithm == "auto" else []
        parts.append([s, 7 * s] + S[s] + tail)  # what source s sends this rank
    values = np.asarray(parts, dtype=np.int64).reshape(-1)
    plan, payload = settle_plan(values, S[rank], k, rank, algorithm, topo, model, 64)
    assert payload == [[s, 7 * s] for s in range(R)]
    assert list(plan.out_splits) == [S[s][rank] for s in range(R)]
    assert plan.matrix.tolist() == S
    if algorithm == "auto":
        assert plan.algorithm == choose_algorithm(S, 64, topo, model)
        assert plan.reverse().algorithm == choose_algorithm(transpose(S), 64, topo, model)
    assert plan.reverse().splits is plan.splits.transposed()


def test_cost_model_from_platform_files(tmp_path: Path) -> None:
    frontier = CostModel.from_platform("frontier")
    assert frontier.nic_bandwidth == pytest.approx(25e9)
    assert frontier.local_bandwidth == pytest.approx(65.6e9)
    assert frontier.alpha_net == pytest.approx(10e-6) == frontier.halo_overhead_s
    assert frontier.alpha_local == pytest.approx(5e-6)
    assert not frontier.flat_pairwise and "frontier" in frontier.source
    assert "frontier" in frontier.describe() and "25000.0 MB/s" in frontier.describe()
    by_path = CostModel.from_platform(PLATFORM_DIR / "frontier.toml")
    assert by_path == frontier
    local = CostModel.from_platform("local")  # this machine's gloo measurements
    assert local.flat_pairwise and local.flat_empty_messages
    with pytest.raises(ValueError, match="unknown platform 'nowhere'; valid: .*frontier"):
        CostModel.from_platform("nowhere")
    bad = tmp_path / "bad.toml"
    bad.write_text('name = "bad"\n[network]\nnic_bandwidth_gbs = 1.0\n')
    with pytest.raises(ValueError, match="network_latency_us"):
        CostModel.from_platform(bad)
    assert "emulator" in CostModel.emulator(1000).source
    assert CostModel.emulator(1000).nic_bandwidth == pytest.approx(125e6)


def _auto_without_model(rank: int, world: int, group: dist.ProcessGroup) -> list[str]:
    two_nodes, one_node = Topology.uniform(2, 1), Topology.uniform(1, 2)
    errors = value_errors((
        lambda: all_to_all(torch.zeros(2, 1), [1, 1], group, "auto", two_nodes),
        lambda: plan_all_to_all([1, 1], group, "auto", two_nodes)))
    # one node: nothing to decide, flat runs without a model
    y, out = all_to_all(torch.full((2, 1), float(rank)), [1, 1], group, "auto", one_node)
    errors.append(str((y.flatten().tolist(), out)))
    return errors


@pytest.mark.multiproc
def test_auto_across_nodes_needs_a_cost_model() -> None:
    for rank, errors in enumerate(run_local(_auto_without_model, 2)):
        for e in errors[:2]:
            assert "needs cost_model" in e and "from_platform" in e and "calibrate" in e
        assert errors[2] == str(([0.0, 1.0], [1, 1])), rank
