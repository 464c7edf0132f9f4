"""The dedup dispatch's transport pieces against their definitions.

`p2p_start` (X1 / X2 as point-to-point ops with the peers that have rows) must equal
`all_to_all_single` (`comm.collectives.flat.reference_all_to_all`, plain torch on every rank's
input) for any splits, zeros and self rows included, with several exchanges of the same rank
pairs in flight at once (the pipeline's chunks), and its reverse plan must bring the rows
back. `meta_columns` must carry int32 slots, -1 included, bit for bit through rows of every
float dtype. Exact comparisons: the rows are copied, never computed on.
"""

from __future__ import annotations

import pytest
import torch

from comm import run_local
from comm.collectives.alltoall import AllToAllPlan
from comm.collectives.dedup import meta_columns
from comm.collectives.flat import reference_all_to_all

WORLD = 4


def _matrix(seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    S = torch.randint(0, 5, (WORLD, WORLD), generator=g)
    S[S == 1] = 0  # plenty of empty pairs, as in X1 / X2
    S[0, 2] = S[2, 0] = 0  # one pair with nothing either way
    return S.tolist()


def _rows(s: int, n: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * seed + s)
    return torch.randn(n, 3, generator=g, dtype=torch.float64)


def _worker(rank: int, world: int, group) -> list[list[float]]:
    from comm.collectives.overlap import start_exchange

    out = []
    started = []
    for seed in (1, 2, 3):  # three exchanges in flight together, then waited in order
        S = _matrix(seed)
        x = _rows(rank, sum(S[rank]), seed)
        plan = AllToAllPlan(tuple(S[rank]), tuple(S[s][rank] for s in range(world)), "p2p")
        started.append((x, plan, start_exchange(x, plan, group)))
    for x, plan, ex in started:
        y = ex.wait()
        out.append(y.tolist())
        back = start_exchange(y, plan.reverse(), group).wait()  # the mirrored exchange
        assert torch.equal(back, x)
    return out


@pytest.mark.multiproc
def test_p2p_equals_all_to_all():
    got = run_local(_worker, WORLD, timeout_s=120)
    for i, seed in enumerate((1, 2, 3)):
        S = _matrix(seed)
        want = reference_all_to_all([_rows(s, sum(S[s]), seed) for s in range(WORLD)], S)
        for rank in range(WORLD):
            assert torch.equal(torch.tensor(got[rank][i], dtype=torch.float64).reshape(-1, 3),
                               want[rank]), (seed, rank)


@pytest.mark.parametrize("dtype,k,cols", [(torch.float32, 4, 4), (torch.bfloat16, 4, 8),
                                          (torch.float64, 4, 2), (torch.float64, 3, 2),
                                          (torch.float16, 1, 2)])
def test_meta_columns_carry_slots_bit_for_bit(dtype, k, cols):
    assert meta_columns(k, dtype) == cols
    n32 = cols * torch.empty(0, dtype=dtype).element_size() // 4
    slots = torch.tensor([[5, -1, 1023, 0][:k], [-1] * k, [2**31 - 1] * k], dtype=torch.int32)
    meta = torch.full((3, n32), -1, dtype=torch.int32)
    meta[:, :k] = slots
    x = torch.randn(3, 5).to(dtype)
    row = torch.cat([x, meta.view(dtype)], 1)  # as pipeline._dedup_chunk builds X1's rows
    moved = row.clone()[torch.tensor([0, 1, 2])]  # copies, as the exchange makes
    back = moved[:, 5:].contiguous().view(torch.int32)[:, :k]
    assert torch.equal(back, slots)
