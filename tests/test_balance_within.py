"""balance.plan_swaps_within: migration that keeps every expert inside its block of ranks
(routing bound to nodes), against plan_swaps on each block alone."""

from __future__ import annotations

import numpy as np
import pytest

from balance import apply_swaps, plan_swaps, plan_swaps_within, rank_loads


@pytest.mark.parametrize("seed", range(5))
def test_swaps_stay_in_their_block_and_never_raise_the_max(seed):
    rng = np.random.default_rng(seed)
    E, R = 16, 4
    blocks = [[0, 1], [2, 3]]
    w = rng.gamma(0.7, 100.0, E)
    p = np.repeat(np.arange(R), E // R)
    rng.shuffle(p[:8])  # experts 0..7 on ranks 0, 1 (node 0), 8..15 on ranks 2, 3
    rng.shuffle(p[8:])
    p[:8] = np.where(p[:8] >= 2, p[:8] - 2, p[:8])
    p[8:] = np.where(p[8:] < 2, p[8:] + 2, p[8:])
    swaps = plan_swaps_within(w, p, R, blocks, max_swaps=4)
    node = np.array([0, 0, 1, 1])
    q = np.asarray(apply_swaps(p, swaps))
    assert (node[q] == node[p]).all()  # nobody left its node
    assert rank_loads(w, q, R).max() <= rank_loads(w, p, R).max() + 1e-9
    # each block planned alone gives the same swaps, in block order
    want = []
    for b in blocks:
        ex = [e for e in range(E) if p[e] in b]
        sub = plan_swaps(w[ex], [b.index(int(p[e])) for e in ex], len(b), 4)
        want += [(ex[s.expert_a], ex[s.expert_b]) for s in sub]
    assert [(s.expert_a, s.expert_b) for s in swaps] == want


def test_blocks_must_partition_the_ranks():
    with pytest.raises(ValueError, match="partition"):
        plan_swaps_within([1.0] * 4, [0, 1, 2, 3], 4, [[0, 1], [1, 2]])
