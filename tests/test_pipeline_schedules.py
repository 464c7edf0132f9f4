"""Schedules as data: builders, validate, bubble, peak in-flight, transfers, renderers.

Pure Python, no processes. Expected values are hand-derived: GPipe and 1F1B idle
(p-1)/(m+p-1) of a unit timeline; 1F1B rank i holds min(p-i, m) micro-batches, GPipe all m.
"""

from __future__ import annotations

import json
from fractions import Fraction

import pytest
from hypothesis import given
from hypothesis import strategies as st

import pipeline
from pipeline import Action, bubble_fraction, build, peak_inflight, validate

ranks = st.integers(1, 6)
mbs = st.integers(1, 10)


def _all_actions(sched: pipeline.Schedule) -> list[Action]:
    return [a for slots in sched.values() for a in slots if a is not None]


@given(p=ranks, m=mbs, name=st.sampled_from(["gpipe", "1f1b", "zb-h1"]))
def test_builders_validate(p: int, m: int, name: str) -> None:
    sched = build(name, p, m)
    validate(sched)
    assert sorted(sched) == list(range(p))
    kinds = "FBW" if name == "zb-h1" else "FB"
    assert len(_all_actions(sched)) == len(kinds) * p * m
    # The unit layout is tight: replaying the orders with unit costs gives the same timeline.
    assert bubble_fraction(sched, costs=dict.fromkeys(kinds, 1.0)) == pytest.approx(
        bubble_fraction(sched))


@given(p=ranks, k=st.integers(1, 3), v=st.integers(1, 4))
def test_interleaved_validates(p: int, k: int, v: int) -> None:
    m = k * p
    sched = build("interleaved-1f1b", p, m, n_virtual=v)
    validate(sched)
    s2r = pipeline.stage2rank(sched)
    assert s2r == {s: s % p for s in range(p * v)}
    assert len(_all_actions(sched)) == 2 * p * v * m


@given(p=ranks, m=mbs, v=st.integers(1, 3))
def test_forward_only_validates(p: int, m: int, v: int) -> None:
    """Evaluation's schedule: each stage's forward once per micro-batch, no backward, stage s
    on rank s % p; not a training schedule (not among the names `build` takes)."""
    sched = pipeline.forward_only(p, m, v)
    validate(sched)
    assert pipeline.is_forward_only(sched)
    assert pipeline.stage2rank(sched) == {s: s % p for s in range(p * v)}
    assert sorted(_all_actions(sched)) == sorted(Action(s, "F", i) for s in range(p * v)
                                                 for i in range(m))
    assert "forward_only" not in pipeline.schedule_names()
    training = build("1f1b", p, m)
    assert not pipeline.is_forward_only(training)
    if p * m == 1:
        return  # without its only B, 1f1b's one F is a forward-only schedule
    with pytest.raises(ValueError, match="is missing"):  # a training schedule without one B
        validate({r: [a if a != Action(0, "B", 0) else None for a in slots]
                  for r, slots in training.items()})


@given(p=ranks, m=mbs)
def test_gpipe_1f1b_bubble_and_memory(p: int, m: int) -> None:
    expected = Fraction(p - 1, m + p - 1)
    for name in ("gpipe", "1f1b"):
        sched = build(name, p, m)
        assert Fraction(bubble_fraction(sched)).limit_denominator(1000) == expected
        assert len(sched[0]) == 2 * (m + p - 1)
    assert peak_inflight(build("gpipe", p, m)) == dict.fromkeys(range(p), m)
    assert peak_inflight(build("1f1b", p, m)) == {i: min(p - i, m) for i in range(p)}


@given(p=st.integers(2, 6), extra=st.integers(0, 6))
def test_zb_h1_beats_1f1b_at_1f1b_memory(p: int, extra: int) -> None:
    """With unit F, B, W the ZB-H1 makespan is 3m + p - 1 (vs 3m + 2(p-1) for 1F1B whose
    backward costs B + W = 2) and no rank holds more than 1F1B's stage-0 peak min(p, m)."""
    m = p + extra
    zb = build("zb-h1", p, m)
    assert len(zb[0]) == 3 * m + p - 1
    one = build("1f1b", p, m)
    assert bubble_fraction(zb) < bubble_fraction(one, costs={"F": 1.0, "B": 2.0})
    assert max(peak_inflight(zb).values()) <= min(p, m)


def test_hand_checked_small_cases() -> None:
    assert bubble_fraction(build("gpipe", 4, 8)) == pytest.approx(3 / 11)
    assert bubble_fraction(build("1f1b", 2, 3)) == pytest.approx(1 / 4)
    # Interleaving 2 chunks on 4 ranks, 8 micro-batches, unit steps per chunk:
    # (p-1) / (v*m + p-1) = 3 / 19.
    assert bubble_fraction(build("interleaved-1f1b", 4, 8, n_virtual=2)) == pytest.approx(3 / 19)
    one = build("1f1b", 2, 3)
    assert [str(a) if a else "." for a in one[0]] == ["0F0", "0F1", ".", "0B0", "0F2", "0B1",
                                                     ".", "0B2"]
    assert [str(a) if a else "." for a in one[1]] == [".", "1F0", "1B0", "1F1", "1B1", "1F2",
                                                     "1B2", "."]
    # Measured-cost replay: F=1, B=2 on 2 ranks, 1 micro-batch: F F B B = 6, busy 6 of 12.
    assert bubble_fraction(build("1f1b", 2, 1), costs={"F": 1, "B": 2}) == pytest.approx(0.5)


@pytest.mark.parametrize(
    ("name", "p", "m", "kw", "match"),
    [
        ("gpipe", 0, 4, {}, "n_ranks=0"),
        ("1f1b", 2, 0, {}, "n_microbatches=0"),
        ("interleaved-1f1b", 4, 6, {}, "n_microbatches=6, n_ranks=4"),
        ("interleaved-1f1b", 2, 4, {"n_virtual": 0}, "n_virtual=0"),
        ("nope", 2, 4, {}, "unknown schedule 'nope'"),
        ("1f1b", 2, 4, {"n_virtual": 2}, "unexpected options"),
    ],
)
def test_invalid_build_raises(name: str, p: int, m: int, kw: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        build(name, p, m, **kw)


@given(p=ranks, m=mbs, bad_p=st.integers(-3, 0))
def test_invalid_counts_raise(p: int, m: int, bad_p: int) -> None:
    with pytest.raises(ValueError, match=f"n_ranks={bad_p}"):
        build("1f1b", bad_p, m)
    with pytest.raises(ValueError, match=f"n_microbatches={bad_p}"):
        build("gpipe", p, bad_p)


def test_validate_names_the_offending_action() -> None:
    good = build("1f1b", 2, 2)
    missing = {r: [a if a != Action(1, "B", 1) else None for a in s] for r, s in good.items()}
    with pytest.raises(ValueError, match="1B1 is missing on rank 1"):
        validate(missing)
    early = {0: [Action(0, "F", 0), None, None, Action(0, "B", 0)],
             1: [Action(1, "F", 0), Action(1, "B", 0), None, None]}
    with pytest.raises(ValueError, match="1F0 on rank 1 at step 0 needs 0F0"):
        validate(early)
    twice = {0: [Action(0, "F", 0), Action(0, "F", 0), Action(0, "B", 0)]}
    with pytest.raises(ValueError, match="0F0 runs twice"):
        validate(twice)
    split_rank = {0: [Action(0, "F", 0), None], 1: [None, Action(0, "B", 0)]}
    with pytest.raises(ValueError, match="stage 0 appears on ranks 0 and 1"):
        validate(split_rank)
    partial_w = {0: [Action(0, "F", 0), Action(0, "F", 1), Action(0, "B", 0), Action(0, "B", 1),
                     Action(0, "W", 0)]}
    with pytest.raises(ValueError, match="0W1 is missing"):
        validate(partial_w)
    with pytest.raises(ValueError, match="ranks must be 0..1"):
        validate({0: [Action(0, "F", 0)], 2: []})
    with pytest.raises(ValueError, match="kind 'X'"):
        Action(0, "X", 0)


@given(st.integers(2, 5), st.integers(1, 9), st.sampled_from([0.0, 0.25, 0.5, 1.0, 3.0]))
def test_gpipe_bubble_with_transfer_time(p: int, m: int, t: float) -> None:
    # F = B = 1 and a hand-over of t per stage boundary: the fill and the drain each take
    # (p-1)(1+t), so the makespan is 2m + 2(p-1)(1+t) and the bubble 1 - m / (m + (p-1)(1+t)).
    s = build("gpipe", p, m)
    got = bubble_fraction(s, {"F": 1.0, "B": 1.0}, transfer=t)
    assert got == pytest.approx(1 - m / (m + (p - 1) * (1 + t)), abs=1e-12)
    # 1F1B waits on the round trip in its steady state too: never less bubble than GPipe's
    # fill and drain with the same hand-over time, and more with a longer one.
    f = build("1f1b", p, m)
    assert bubble_fraction(f, {"F": 1.0, "B": 1.0}, transfer=t) >= got - 1e-12
    assert bubble_fraction(f, {"F": 1.0, "B": 1.0}, transfer=t + 1) > bubble_fraction(
        f, {"F": 1.0, "B": 1.0}, transfer=t)
    with pytest.raises(ValueError, match=r"transfer=-1 must be >= 0"):
        bubble_fraction(s, transfer=-1)


def test_simulate_detects_deadlock() -> None:
    # Rank 0 insists on 0B0 before 0F1 and rank 1 on 1F1 before 1B0: an order deadlock,
    # even though each slot list on its own looks plausible.
    orders = {0: [Action(0, "F", 0), Action(0, "B", 0), Action(0, "F", 1), Action(0, "B", 1)],
              1: [Action(1, "F", 1), Action(1, "F", 0), Action(1, "B", 0), Action(1, "B", 1)]}
    with pytest.raises(ValueError, match="deadlocks"):
        pipeline.simulate(orders)


@given(p=st.integers(2, 5), m=st.integers(1, 6),
       name=st.sampled_from(["gpipe", "1f1b", "zb-h1", "interleaved-1f1b"]))
def test_transfers_match_dependencies(p: int, m: int, name: str) -> None:
    """Every cross-stage dependency is exactly one transfer; sends pair with receives."""
    if name == "interleaved-1f1b":
        m *= p
    sched = build(name, p, m)
    xs = pipeline.derive_transfers(sched)
    S = pipeline.n_stages(sched)
    assert len(xs) == 2 * (S - 1) * m  # activations forward, gradients backward
    s2r = pipeline.stage2rank(sched)
    for x in xs:
        assert x.src == s2r[x.producer.stage] and x.dst == s2r[x.consumer.stage]
        assert x.producer in pipeline.schedule.dependencies(x.consumer, S)
    plans = {r: set(pipeline.comm_plan(sched, r)) for r in sched}
    for r, plan in plans.items():
        for kind, peer, x in plan:
            other = "recv" if kind == "send" else "send"
            assert (other, r, x) in plans[peer]


def test_table_trace_and_plot(tmp_path) -> None:
    sched = build("zb-h1", 3, 4)
    table = pipeline.format_table(sched)
    lines = table.splitlines()
    assert len(lines) == 1 + len(sched[0])
    assert lines[1].split("|")[1].split()[0] == "0F0"
    spans = pipeline.timeline_spans(sched)
    trace = pipeline.chrome_trace(spans, tmp_path / "t.json", time_unit_us=1000)
    assert json.loads((tmp_path / "t.json").read_text()) == trace
    xs = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    assert len(xs) == 3 * 3 * 4
    assert {e["tid"] for e in xs} == {0, 1, 2}
    pipeline.plot_timeline(spans, tmp_path / "t.png", title="zb-h1")
    assert (tmp_path / "t.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@given(p=ranks, m=mbs, name=st.sampled_from(["gpipe", "1f1b", "zb-h1"]),
       nbytes=st.integers(1, 10**6))
def test_activation_bytes_is_weighted_inflight(p: int, m: int, name: str, nbytes: int) -> None:
    sched = build(name, p, m)
    weighted = pipeline.peak_activation_bytes(sched, dict.fromkeys(range(p), nbytes))
    assert weighted == {r: k * nbytes for r, k in peak_inflight(sched).items()}


def test_activation_bytes_uneven_stages() -> None:
    # Interleaved, 1 rank, 2 chunks, 1 micro-batch: F0 F1 then B1 B0; both chunks alive
    # together at the peak, so the peak is the sum, not 2 x the larger chunk.
    sched = build("interleaved-1f1b", 1, 1, n_virtual=2)
    assert pipeline.peak_activation_bytes(sched, {0: 3.0, 1: 5.0}) == {0: 8.0}
    with pytest.raises(ValueError, match=r"lacks stages \[1\]"):
        pipeline.peak_activation_bytes(sched, {0: 3.0})
