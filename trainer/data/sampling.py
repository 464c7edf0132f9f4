"""Which windows each training step reads: epochs without replacement and weighted blends.

A source (one token file's training split of N tokens) has n = (N - 1) // S windows of S + 1
tokens, window w starting at token w * S: consecutive windows share one token (the last target
of one is the first input of the next), so one epoch reads every token once as an input.

Global sample index g = step * B + j (B the global batch, j its row). Data shard i of D takes
rows [i * B / D, (i + 1) * B / D) of every step, so the union over shards is the global batch
whatever the layout, and the order is a pure function of (seed, g): resuming at any step, under
any layout or DP size, reads exactly what an uninterrupted run would have read.

One source: sample g is the (g mod n)-th window of epoch g // n in that epoch's shuffled order,
`permute(g mod n, n, (seed, 0, epoch))`, a keyed Feistel bijection of [0, n) (cycle-walking on
the next even power of two): any position of any epoch is computed directly, and no index of n
entries is held (a 10 GB token file needs no per-epoch array).

A blend of K sources with weights w_d (summing to 1) interleaves them the way a divisor
apportionment does (Sainte-Lague / Webster): the k-th sample of source d has the virtual time
(k + 1/2) / w_d and samples are taken in order of (time, d). After g samples source d has been
drawn c_d(g) = g * w_d +- 1 times (Megatron's blended datasets use a greedy rule with the same
bound, which needs the whole history; this one gives c_d(g) for any g in O(K^2 log g) exact
integer steps, so a resumed run starts at once). Source d walks its own epochs: its c-th sample
is window `permute(c mod n_d, n_d, (seed, d, c // n_d))`.

Shape legend: B global batch, S sequence length, K sources, n windows of a source.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Sequence
from dataclasses import dataclass
from fractions import Fraction
from pathlib import Path

import numpy as np

__all__ = ["SAMPLINGS", "permute", "parse_blend", "is_blend", "WindowOrder", "BlendError"]

SAMPLINGS = ("epoch", "random")
_ROUNDS = 6  # Feistel rounds: >= 4 make a keyed pseudo-random permutation (Luby-Rackoff)
_M64 = np.uint64(0xFFFFFFFFFFFFFFFF)


class BlendError(ValueError):
    """A malformed blend spec; the message names the bad part and what is valid."""


def _mix(x: np.ndarray) -> np.ndarray:
    """splitmix64's finaliser on uint64 (wrapping arithmetic): a well-spread round function."""
    z = x + np.uint64(0x9E3779B97F4A7C15)
    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return z ^ (z >> np.uint64(31))


def permute(pos: np.ndarray, n: int, key: Sequence[int]) -> np.ndarray:
    """Position(s) `pos` (0 <= pos < n) through the bijection of [0, n) keyed by `key`."""
    if n < 1:
        raise ValueError(f"permute needs n >= 1 elements, got {n}")
    pos = np.asarray(pos, dtype=np.uint64)
    if n == 1:
        return np.zeros_like(pos, dtype=np.int64)
    bits = max(2, math.ceil(math.log2(n)))
    half = (bits + 1) // 2  # the domain 2^(2 half) is < 4 n: at most ~4 walks per element
    mask = np.uint64((1 << half) - 1)
    keys = np.random.default_rng([int(k) for k in key]).integers(
        0, 2**63, size=_ROUNDS, dtype=np.int64).astype(np.uint64)
    sh = np.uint64(half)

    def encrypt(x: np.ndarray) -> np.ndarray:
        left, right = x >> sh, x & mask
        with np.errstate(over="ignore"):
            for k in keys:
                left, right = right, left ^ (_mix(right ^ k) & mask)
        return (left << sh) | right

    out = encrypt(pos)
    bad = out >= np.uint64(n)
    while bad.any():  # cycle-walking: the cycle through an in-range x returns in range
        out[bad] = encrypt(out[bad])
        bad = out >= np.uint64(n)
    return out.astype(np.int64)


def is_blend(spec: str) -> bool:
    """Whether a `--data SPEC` is a blend `a.bin:0.7,b.bin:0.3` (every item PATH:NUMBER)."""
    items = spec.split(",")
    for item in items:
        path, sep, w = item.rpartition(":")
        if not sep or not path:
            return False
        try:
            Fraction(w.strip())
        except (ValueError, ZeroDivisionError):
            return False
    return True


def parse_blend(spec: str) -> list[tuple[str, Fraction]]:
    """`a.bin:0.7,b.bin:0.3` -> [(path, weight)], weights exact fractions summing to 1.

    Weights are read as exact decimals (or fractions like 1/3); their sum must be 1 within
    1e-6 (so 0.333333 x 3 is accepted) and they are then divided by it exactly."""
    if not spec.strip():
        raise BlendError("--data.blend is empty; give FILE:WEIGHT,FILE:WEIGHT,... "
                         "(e.g. a.bin:0.7,b.bin:0.3)")
    out: list[tuple[str, Fraction]] = []
    for item in spec.split(","):
        path, sep, w = item.strip().rpartition(":")
        if not sep or not path:
            raise BlendError(f"--data.blend item {item!r} is not FILE:WEIGHT "
                             f"(e.g. a.bin:0.7,b.bin:0.3)")
        try:
            weight = Fraction(w.strip())
        except (ValueError, ZeroDivisionError):
            raise BlendError(f"--data.blend item {item!r}: weight {w!r} is not a number") from None
        if weight <= 0:
            raise BlendError(f"--data.blend item {item!r}: weight {w} must be > 0 "
                             f"(drop the source instead)")
        if any(Path(p) == Path(path) for p, _ in out):
            raise BlendError(f"--data.blend names {path!r} twice; give each file once")
        out.append((path, weight))
    total = sum((w for _, w in out), Fraction(0))
    if abs(total - 1) > Fraction(1, 10**6):
        raise BlendError(f"--data.blend weights {', '.join(str(float(w)) for _, w in out)} sum "
                         f"to {float(total):g}, not 1")
    return [(p, w / total) for p, w in out]


def _keys(d: int, c: int, m: int, n: int):
    """(key, source, k) of source d's samples c .. c + n - 1, in key order."""
    return (((2 * k + 1) * m, d, k) for k in range(c, c + n))


@dataclass(frozen=True)
class Windows:
    """The windows rows [g0, g0 + len) of the global sample order read: source index, the
    source's own sample count c (its epoch is c // n_d) and the start token of each."""

    src: np.ndarray  # [n] int64
    count: np.ndarray  # [n] int64: the per-source sample index c
    starts: np.ndarray  # [n] int64: token offset of the window in its source's training split


class WindowOrder:
    """The epoch order over K >= 1 sources (module docstring); pure in (seed, g)."""

    def __init__(self, n_windows: Sequence[int], weights: Sequence[Fraction], seq_len: int,
                 seed: int) -> None:
        if len(n_windows) != len(weights) or not n_windows:
            raise ValueError(f"{len(n_windows)} sources but {len(weights)} weights")
        if any(n < 1 for n in n_windows):
            raise ValueError(f"every source needs >= 1 window, got {list(n_windows)}")
        self.n_windows, self.seq_len, self.seed = list(n_windows), seq_len, seed
        ws = [Fraction(w) for w in weights]
        # integer weights W_d and key multipliers M_d = lcm(W) / W_d: the k-th sample of d has
        # the exact integer key (2k + 1) M_d, proportional to its virtual time (k + 1/2) / w_d
        q = math.lcm(*(w.denominator for w in ws))
        W = [int(w * q) for w in ws]
        L = math.lcm(*W)
        self.M = [L // x for x in W]
        self.weights = ws

    # -- the blend interleaving -----------------------------------------------------------------
    def _rank(self, d: int, k: int) -> int:
        """Position in the global order of source d's k-th sample."""
        v = (2 * k + 1) * self.M[d]
        r = k
        for e, m in enumerate(self.M):
            if e < d:  # ties go to the lower source index
                r += (v // m + 1) // 2
            elif e > d:
                r += ((v + m - 1) // m) // 2
        return r

    def counts_before(self, g: int) -> list[int]:
        """c_d(g): samples of each source among the first g of the global order."""
        if len(self.M) == 1:
            return [g]
        counts = []
        for d in range(len(self.M)):
            lo, hi = 0, g  # the smallest k with rank(d, k) >= g; rank rises strictly with k
            while lo < hi:
                mid = (lo + hi) // 2
                if self._rank(d, mid) >= g:
                    hi = mid
                else:
                    lo = mid + 1
            counts.append(lo)
        assert sum(counts) == g, (counts, g)
        return counts

    def sources(self, g0: int, n: int) -> tuple[np.ndarray, np.ndarray]:
        """(source, per-source sample index) of global samples g0 .. g0 + n - 1."""
        c0 = self.counts_before(g0)
        if len(self.M) == 1:
            return np.zeros(n, dtype=np.int64), np.arange(g0, g0 + n, dtype=np.int64)
        streams = [_keys(d, c, m, n) for d, (c, m) in enumerate(zip(c0, self.M, strict=True))]
        src = np.empty(n, dtype=np.int64)
        cnt = np.empty(n, dtype=np.int64)
        for i, (_, d, k) in enumerate(heapq.merge(*streams)):
            if i == n:
                break
            src[i], cnt[i] = d, k
        return src, cnt

    # -- windows ----------------------------------------------------------------------------------
    def windows(self, g0: int, n: int) -> Windows:
        """The windows of global samples g0 .. g0 + n - 1."""
        src, cnt = self.sources(g0, n)
        starts = np.empty(n, dtype=np.int64)
        for d, nw in enumerate(self.n_windows):
            sel = src == d
            if not sel.any():
                continue
            c = cnt[sel]
            epoch, pos = c // nw, c % nw
            w = np.empty_like(c)
            for e in np.unique(epoch):  # a batch crosses at most a few epoch boundaries
                at = epoch == e
                w[at] = permute(pos[at], nw, (self.seed, d, int(e)))
            starts[sel] = w * self.seq_len
        return Windows(src, cnt, starts)

    def epochs(self, g: int) -> list[float]:
        """Epochs of each source completed after g global samples (fractional)."""
        return [c / n for c, n in zip(self.counts_before(g), self.n_windows, strict=True)]
