"""The machine-speed probe (`tuner.measure.speed_probe`) and how bench_tuner_validate uses it:
a row's prediction is scaled by (mean of its two probes) / the platform's probe, and a row
whose two probes differ by more than `UNSTEADY` is marked unsteady."""

from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest

from tuner.measure import speed_probe

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import bench_tuner_validate as bv  # noqa: E402


def test_speed_fields_by_hand():
    got = bv.speed_fields(0.040, 0.044, 0.046)
    assert got["speed_ratio"] == pytest.approx(0.045 / 0.040, rel=1e-12)
    assert got["unsteady"] is False  # 0.046 / 0.044 = 1.045
    assert bv.speed_fields(0.040, 0.040, 0.045)["unsteady"] is True  # 1.125 > 1.10
    assert bv.speed_fields(0.040, 0.045, 0.040)["unsteady"] is True  # 0.889: -11 %
    none = bv.speed_fields(None, 0.05, 0.05)  # the platform was never probed: not scaled
    assert none["speed_ratio"] == 1.0 and none["probe_platform_s"] is None


def test_platform_probe_file(tmp_path):
    pf = tmp_path / "tuner_validate_platform_w2.toml"
    assert bv.probe_path(pf).name == "tuner_validate_platform_w2.probe.json"
    assert bv.platform_probe(pf) is None
    bv.probe_path(pf).write_text('{"probe_s": 0.0375, "rounds": 40}\n')
    assert bv.platform_probe(pf) == 0.0375


def test_probe_runs_and_refuses_bad_arguments():
    t = speed_probe(1, rounds=2)
    assert math.isfinite(t) and 0 < t < 60
    with pytest.raises(ValueError, match="n_procs=0"):
        speed_probe(0)
    with pytest.raises(ValueError, match="rounds=0"):
        speed_probe(2, rounds=0)
