"""The pure parts of benchmarks/bench_tuner_validate.py: one row from several passes."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))

import bench_tuner_validate as b  # noqa: E402

from tuner.launch import Measured  # noqa: E402


def _pass(step: float, act: float, act_max: float, imb: float, fwd: float, tag: str):
    return (Measured(step, 100.0, act, act_max, imb, 7), {"fwd_bwd_s": fwd, "optim_s": 0.01},
            (1.0, 2.0), {"speed_ratio": tag})


def test_a_slow_pass_does_not_set_the_row():
    runs = [_pass(0.40, 50.0, 60.0, 1.4, 0.30, "a"), _pass(0.52, 52.0, 70.0, 1.5, 0.45, "b"),
            _pass(0.41, 51.0, 61.0, 1.3, 0.31, "c")]
    m, parts, load, speed = b.combine_passes(runs)
    assert m.step_time_s == 0.41 and m.act_peak_bytes == 51.0 and m.act_peak_bytes_max == 70.0
    assert (m.state_bytes, m.imbalance, m.steps) == (100.0, 1.4, 21)
    assert parts == {"fwd_bwd_s": 0.31, "optim_s": 0.01}
    assert load == (1.0, 2.0) and speed == {"speed_ratio": "c"}  # the median pass's probes
    one = b.combine_passes(runs[:1])
    assert one[0] == runs[0][0] and one[3] == {"speed_ratio": "a"}


def test_repeats_must_be_positive(tmp_path):
    with pytest.raises(ValueError, match="--repeats=0 must be >= 1"):  # before any measuring
        b.main(["--repeats", "0", "--out", str(tmp_path)])


def test_zero_broadcast_and_its_copies_are_the_optimizers_part():
    """The trainer times ZeRO's weight broadcast inside its optimizer step, with the pack /
    unpack around it: both go to the predicted optimizer part, the reduction to grad sync."""
    p = {"time": {"compute": 0.05, "dp_sync": 0.016, "optimizer": 0.004, "grad_post": 0.002,
                  "step_syncs": 0.001},
         "dp_collectives": {"all_reduce": 0.010, "broadcast": 0.004, "broadcast_copy": 0.002}}
    parts = b.predicted_parts(p)
    assert parts["optim_s"] == pytest.approx(0.004 + 0.004 + 0.002)
    assert parts["grad_sync_s"] == pytest.approx(0.010 + 0.002)
    assert parts["fwd_bwd_s"] == pytest.approx(0.05) and parts["other_s"] == 0.001


def test_an_earlier_runs_extra_measurements_are_found_for_removal(tmp_path):
    """A record of 3 passes after one of 5 must not keep the 5-pass record's .m4 / .m5 files
    beside its own median (repredict_tuner_records.py would read them as its own)."""
    names = [f"tuner_validate_platform_w{w}.m{k}{ext}" for w in (2, 4) for k in range(1, 6)
             for ext in (".toml", ".raw.json", ".probe.json")]
    names += [f"tuner_validate_platform_w{w}{ext}" for w in (2, 4)
              for ext in (".toml", ".probe.json")] + ["tuner_validate.jsonl"]
    for n in names:
        (tmp_path / n).write_text("x")
    got = {f.name for f in b.stale_measurements(tmp_path, 2)}
    assert got == {n for n in names if n.startswith("tuner_validate_platform_w2.m")}
    assert len(got) == 15  # five measurements x (toml, raw, probe); the median and w4 kept


def test_stolen_cpu_share_from_proc_stat():
    import _common as c
    # /proc/stat of a 2-CPU guest: user nice system idle iowait irq softirq steal guest guest_nice
    first = c.cpu_times("cpu  600 0 100 250 20 0 10 20 0 0\ncpu0 300 0 50 125 10 0 5 10 0 0\n")
    later = c.cpu_times("cpu  700 0 120 330 20 0 10 70 5 0\ncpu0 350 0 60 165 10 0 5 35 5 0\n")
    assert first == (20, 1000) and later == (70, 1250)  # guest ticks are inside user already
    assert c.steal_fraction(first, later) == pytest.approx(50 / 250)
    assert c.steal_fraction(first, first) is None and c.steal_fraction(None, later) is None
    assert c.cpu_times("cpu  1 2 3 4\n") is None  # no steal column: unknown, not zero
    now = c.cpu_times()  # this machine's own file, where there is one
    if Path("/proc/stat").is_file():
        assert now is not None and 0 <= now[0] <= now[1]
