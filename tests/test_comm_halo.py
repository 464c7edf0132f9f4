"""HALO (and auto) all-to-all on real gloo processes vs all_to_all_single and plain torch.

Nodes are simulated on one machine with a Topology.uniform of several "nodes": the plan and
the p2p traffic are the same as on a cluster, only the links are loopback.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from conftest import value_errors

from comm import CostModel, Topology, all_to_all, choose_algorithm, plan_all_to_all, run_local
from comm.collectives.flat import reference_all_to_all
from comm.collectives.halo import halo_gather_ints
from comm.cost import decide_from_summaries, row_summary, summary_width

pytestmark = pytest.mark.multiproc


def split_cases(world: int, gpus: int) -> dict[str, list[list[int]]]:
    """Named split matrices S[s][d], identical on every process."""
    g = torch.Generator().manual_seed(world * 7 + gpus)
    rand = torch.randint(0, 6, (world, world), generator=g)
    cases = {"random": rand.clone()}
    zeros = rand.clone()
    zeros[zeros < 3] = 0
    cases["zeros"] = zeros
    empty = rand.clone()
    empty[1, :] = 0  # rank 1 sends nothing
    empty[:, 1] = 0  # ... and receives nothing: a fully empty rank
    empty[:, world - 1] = 0  # the last rank receives nothing
    empty[gpus, :] = 0  # the first rank of node 1 sends nothing
    cases["empty_ranks"] = empty
    remote_only = rand.clone()
    for s in range(world):
        for d in range(world):
            if s // gpus == d // gpus:
                remote_only[s, d] = 0
    cases["remote_only"] = remote_only
    cases["all_empty"] = torch.zeros(world, world, dtype=torch.int64)
    return {k: v.tolist() for k, v in cases.items()}


def _check(rank: int, group: dist.ProcessGroup, S: list[list[int]], topo: Topology,
           algorithm: str, seed: int, model: CostModel | None = None) -> None:
    R = len(S)
    g = torch.Generator().manual_seed(seed)
    xs = [torch.randn(sum(S[s]), 3, generator=g, dtype=torch.float64) for s in range(R)]
    ST = [list(col) for col in zip(*S, strict=True)]
    ws = [torch.randn(sum(ST[s]), 3, generator=g, dtype=torch.float64) for s in range(R)]
    x = xs[rank].clone().requires_grad_(True)
    y, out_splits = all_to_all(x, S[rank], group, algorithm, topology=topo, cost_model=model)
    assert out_splits == [S[s][rank] for s in range(R)]
    assert torch.equal(y, reference_all_to_all(xs, S)[rank]), algorithm
    y_vendor = torch.empty_like(y)
    dist.all_to_all_single(y_vendor, xs[rank], out_splits, S[rank], group=group)
    assert torch.equal(y, y_vendor), algorithm
    (y * ws[rank]).sum().backward()
    # d/dx of sum_r <y_r, w_r> is the mirrored exchange of the w's.
    assert torch.equal(x.grad, reference_all_to_all(ws, ST)[rank]), algorithm
    gx_vendor = torch.empty_like(x.grad)
    dist.all_to_all_single(gx_vendor, ws[rank], S[rank], out_splits, group=group)
    assert torch.equal(x.grad, gx_vendor), algorithm


def _check_plan(rank: int, group: dist.ProcessGroup, S: list[list[int]], topo: Topology,
                algorithm: str, seed: int, model: CostModel | None = None) -> None:
    """plan_all_to_all delivers the payload, settles the sizes and the algorithm of both
    directions as the model decides them, and the planned exchanges are exact."""
    R = len(S)
    ST = [list(col) for col in zip(*S, strict=True)]
    payload = [[rank * 100 + d, S[rank][d], seed] for d in range(R)]
    plan, got = plan_all_to_all(S[rank], group, algorithm, topo, model, 24, payload)
    assert got == [[s * 100 + rank, S[s][rank], seed] for s in range(R)]
    assert list(plan.out_splits) == ST[rank]
    back = plan.reverse()
    assert (list(back.in_splits), list(back.out_splits)) == (ST[rank], S[rank])
    if algorithm == "auto":
        assert model is not None
        assert plan.algorithm == choose_algorithm(S, 24, topo, model)
        assert back.algorithm == choose_algorithm(ST, 24, topo, model)
    else:
        assert plan.algorithm == back.algorithm == algorithm
    g = torch.Generator().manual_seed(seed)
    xs = [torch.randn(sum(S[s]), 3, generator=g, dtype=torch.float64) for s in range(R)]
    ws = [torch.randn(sum(ST[s]), 3, generator=g, dtype=torch.float64) for s in range(R)]
    x = xs[rank].clone().requires_grad_(True)
    y, out = all_to_all(x, S[rank], group, plan=plan)
    assert out == ST[rank] and torch.equal(y, reference_all_to_all(xs, S)[rank])
    (y * ws[rank]).sum().backward()
    assert torch.equal(x.grad, reference_all_to_all(ws, ST)[rank])
    z, out = all_to_all(ws[rank], ST[rank], group, plan=back)  # the mirrored exchange
    assert out == S[rank] and torch.equal(z, reference_all_to_all(ws, ST)[rank])
    assert plan.algorithm in ("flat", "halo") and back.algorithm in ("flat", "halo")


def _straddling_model(S: list[list[int]], topo: Topology) -> CostModel:
    """A concurrent model under which the row summaries of S leave auto undecided."""
    R = topo.world_size
    packed = sum((S[s] + row_summary(S[s], s, topo) for s in range(R)), [])
    stride = R + summary_width(topo)
    for i in range(1, 400):  # flat's NIC rate from 100 down: it crosses HALO's bracket
        model = CostModel(nic_bandwidth=100.0, local_bandwidth=100.0, alpha_net=0.0,
                          alpha_local=0.0, halo_overhead_s=0.0, flat_nic_bandwidth=100.0 / (
                              1 + 0.01 * i))
        if decide_from_summaries(packed, R, stride, 4, topo, model) is None:
            return model
    raise AssertionError("no straddling model found")


def _halo_worker(rank: int, world: int, group: dist.ProcessGroup, nodes: int,
                 gpus: int) -> int:
    topo = Topology.uniform(nodes, gpus)
    checks = 0
    for i, (_name, S) in enumerate(split_cases(world, gpus).items()):
        _check(rank, group, S, topo, "halo", seed=i)
        checks += 1
    # auto with a model that makes per-message cost dominate (picks halo), one that makes
    # the extra hop dominate (picks flat), one whose first round cannot decide (the matrix
    # is gathered) and gloo's pairwise default (decided on the gathered matrix): all exact.
    S = split_cases(world, gpus)["random"]
    models = (CostModel(alpha_net=1.0, halo_overhead_s=0.0),
              CostModel(local_bandwidth=1.0, alpha_net=0.0),
              _straddling_model(S, topo), CostModel.for_backend("gloo"))
    for i, model in enumerate(models):
        for j, Sj in enumerate(split_cases(world, gpus).values()):
            _check(rank, group, Sj, topo, "auto", seed=50 + 10 * i + j, model=model)
        checks += 1
    # Planned ahead (the MoE dispatcher's path): every algorithm, every split case.
    for i, model in enumerate((None, None, *models)):
        algorithm = ("flat", "halo", "auto", "auto", "auto", "auto")[i]
        for j, Sj in enumerate(split_cases(world, gpus).values()):
            _check_plan(rank, group, Sj, topo, algorithm, seed=200 + 10 * i + j, model=model)
        checks += 1
    if nodes >= 3:
        # An EP sub-group spanning nodes (one rank per node + one extra): group ranks differ
        # from global ranks, and the sub-topology comes from restrict().
        members = [0, gpus + 1, 2 * gpus, 2 * gpus + 1]
        sub = dist.new_group(members)
        if rank in members:
            sub_topo = topo.for_group(sub)
            assert sub_topo == topo.restrict(members)
            assert sub_topo.num_nodes == 3
            Ssub = [row[:4] for row in split_cases(4, 1)["empty_ranks"]]
            _check(members.index(rank), sub, Ssub, sub_topo, "halo", seed=70)
            checks += 1
        dist.barrier()
    if nodes == 2:
        # Discovery over a real group with a torchrun-like environment per rank.
        env = {"GROUP_RANK": str(rank // gpus), "LOCAL_RANK": str(rank % gpus),
               "LOCAL_WORLD_SIZE": str(gpus)}
        found = Topology.discover(group, env=env, hostname="host", sysfs_net="/nonexistent")
        expect = Topology.uniform(nodes, gpus)
        assert found.rank2node == expect.rank2node and found.rank2local == expect.rank2local
        checks += 1
    return checks


@pytest.mark.parametrize("nodes,gpus", [(2, 2), (4, 2), (3, 3)])
def test_halo_equals_vendor_forward_and_backward(nodes: int, gpus: int) -> None:
    counts = run_local(_halo_worker, nodes * gpus, nodes, gpus, timeout_s=90)
    assert min(counts) >= len(split_cases(nodes * gpus, gpus)) + 2


def _two_batch_worker(rank: int, world: int, group: dist.ProcessGroup, nodes: int,
                      gpus: int) -> int:
    import comm.collectives.halo

    comm.collectives.halo.PIPELINE_ON_GLOO = False  # phase III as a second batch, the NCCL order
    topo = Topology.uniform(nodes, gpus)
    for i, (_name, S) in enumerate(split_cases(world, gpus).items()):
        _check(rank, group, S, topo, "halo", seed=100 + i)
    return len(split_cases(world, gpus))


def test_halo_two_batch_order_equals_vendor() -> None:
    assert min(run_local(_two_batch_worker, 9, 3, 3, timeout_s=90)) == 5


def _placement(nodes: tuple[int, ...], local: tuple[int, ...]) -> Topology:
    return Topology(rank2node=nodes, rank2local=local, rank2domain=nodes,
                    rank2group=(0,) * len(nodes), rank2nic=(0,) * len(nodes))


def _gather_worker(rank: int, world: int, group: dist.ProcessGroup,
                   cases: list[tuple[Topology, torch.dtype]]) -> list:
    out = []
    for topo, dtype in cases:
        big = 2**40 + rank if dtype == torch.int64 else -(2**31) + rank
        values = [rank * 1000 + i for i in range(5)] + [big, 0]
        got = halo_gather_ints(values, group, topo, torch.device("cpu"), dtype)
        ref = [torch.zeros(len(values), dtype=torch.int64) for _ in range(world)]
        dist.all_gather(ref, torch.tensor(values), group=group)
        out.append((got, [v for t in ref for v in t.tolist()]))
    return out


@pytest.mark.parametrize("world, gathered, flat", [
    # 2x2 node-major (int32 and int64); 2x2 with nodes interleaved over the ranks.
    (4, [(Topology.uniform(2, 2), torch.int32), (Topology.uniform(2, 2), torch.int64),
         (_placement((0, 1, 0, 1), (0, 0, 1, 1)), torch.int64)],
     # one node; one rank per node; nodes of 1 and 3 ranks: no two-level gather.
     [Topology.uniform(1, 4), Topology.uniform(4, 1), _placement((0, 1, 1, 1), (0, 0, 1, 2))]),
    (6, [(Topology.uniform(3, 2), torch.int64), (Topology.uniform(2, 3), torch.int32)], []),
])
def test_two_level_gather_equals_all_gather(world: int, gathered: list, flat: list) -> None:
    cases = gathered + [(t, torch.int64) for t in flat]
    for per_rank in run_local(_gather_worker, world, cases):
        for i, (got, ref) in enumerate(per_rank):
            assert got == ref if i < len(gathered) else got is None


def _mismatch_worker(rank: int, world: int, group: dist.ProcessGroup) -> str:
    try:
        all_to_all(torch.zeros(4, 1), [1] * world, group, "halo", Topology.uniform(1, 2))
    except ValueError as e:
        return str(e)
    return ""


def test_halo_rejects_topology_of_wrong_size() -> None:
    messages = run_local(_mismatch_worker, 4)
    assert all("restrict" in m and "4" in m for m in messages)


def _plan_errors_worker(rank: int, world: int, group: dist.ProcessGroup) -> list[str]:
    topo = Topology.uniform(2, 1)
    plan, _ = plan_all_to_all([1, 2], group, "halo", topo)
    return value_errors((
        lambda: all_to_all(torch.zeros(3, 1), [2, 1], group, plan=plan),
        lambda: all_to_all(torch.zeros(3, 1), [1, 2], group, plan=object()),
        lambda: plan_all_to_all([1, 2], group, "halo", topo, payload=[[1], [1, 2]]),
        lambda: plan_all_to_all([1, 2], group, "auto", topo, row_bytes=0),
        lambda: plan_all_to_all([1, 2], group, "fast", topo)))


def test_plan_rejects_bad_input_before_exchanging() -> None:
    for errors in run_local(_plan_errors_worker, 2):
        assert "differ from the plan's [1, 2]" in errors[0]
        assert "plan_all_to_all" in errors[1]
        assert "equal length" in errors[2] and "[1, 2]" in errors[2]
        assert "row_bytes" in errors[3] and "0" in errors[3]
        assert "'fast'" in errors[4]
