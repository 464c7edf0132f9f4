"""Max-min fair rates by progressive filling, vectorised over flow classes.

Shape legend: C classes, K segments per class, S segments, L links, nnz segment entries.

A class is m_c identical flows (same segments, same size, same start): they always get the
same rate, so it is stored once with multiplicity m_c. Flow f of class c loads link l with
r_c * a_cl, where a_cl = sum over the segments of c of the fraction of l in that segment.

Progressive filling: every unfrozen rate grows by the same increment; the increment stops at
the first link to saturate, i.e. min over links of remaining_l / w_l with
w_l = sum_{unfrozen c} m_c a_cl; the classes crossing a saturated link freeze; repeat until
all classes are frozen. The result is the unique max-min fair allocation. Each round costs
O(C K + nnz) numpy work and freezes at least one link, and the arrays shrink as classes
freeze, so the total is small when, as in symmetric collectives, few distinct levels exist.
"""

from __future__ import annotations

import numpy as np

__all__ = ["max_min_rates"]

_REL_TOL = 1e-9  # a link within this share of its capacity counts as saturated


def max_min_rates(
    segs: np.ndarray,
    mult: np.ndarray,
    seg_ptr: np.ndarray,
    seg_link: np.ndarray,
    seg_frac: np.ndarray,
    capacity: np.ndarray,
) -> tuple[np.ndarray, int]:
    """Per-flow max-min fair rates (bytes/s) of every class, and the number of rounds.

    segs [C, K] segment ids per class (0 = empty segment), mult [C] flows per class (> 0),
    seg_ptr/seg_link/seg_frac the segment -> (link, fraction) CSR, capacity [L] bytes/s.
    A class crossing no link gets rate inf (nothing limits it).
    """
    segs = np.asarray(segs, dtype=np.int64)
    mult = np.asarray(mult, dtype=np.float64)
    C = segs.shape[0]
    if segs.ndim != 2 or mult.shape != (C,):
        raise ValueError(f"segs must be [C, K] and mult [C], got {segs.shape}, {mult.shape}")
    if C and mult.min() <= 0:
        raise ValueError(f"class multiplicities must be > 0, got min {mult.min()}")
    n_seg = len(seg_ptr) - 1
    L = len(capacity)
    seg_of = np.repeat(np.arange(n_seg), np.diff(seg_ptr))  # segment of every CSR entry
    seg_len = np.diff(seg_ptr)
    rates = np.full(C, np.inf)
    # Classes with no link at all are unconstrained.
    bounded = seg_len[segs].sum(axis=1) > 0
    idx = np.flatnonzero(bounded)  # unfrozen classes (shrinks)
    level = 0.0
    remaining = np.asarray(capacity, dtype=np.float64).copy()
    cap = remaining.copy()
    rounds = 0
    while idx.size:
        rounds += 1
        s_idx = segs[idx]
        seg_count = np.bincount(s_idx.ravel(), weights=np.repeat(mult[idx], s_idx.shape[1]),
                                minlength=n_seg)
        w = np.bincount(seg_link, weights=seg_frac * seg_count[seg_of], minlength=L)
        live = w > 0
        share = np.full(L, np.inf)
        share[live] = remaining[live] / w[live]
        inc = share.min()
        assert np.isfinite(inc), "unfrozen classes but no loaded link"
        level += inc
        remaining[live] -= inc * w[live]
        saturated = live & (remaining <= _REL_TOL * cap + 1e-300)
        remaining[saturated] = 0.0
        seg_sat = np.bincount(seg_of, weights=saturated[seg_link].astype(np.float64),
                              minlength=n_seg) > 0
        frozen = seg_sat[s_idx].any(axis=1)
        rates[idx[frozen]] = level
        idx = idx[~frozen]
    return rates, rounds
