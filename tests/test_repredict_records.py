"""benchmarks/repredict_tuner_records.py: the stored validation records re-predicted."""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))

import repredict_tuner_records as rr  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results"


def _has_history() -> bool:
    p = subprocess.run(["git", "-C", str(ROOT), "log", "--format=%H", "-1", "--",
                        "benchmarks/results/tuner_validate_platform_w4.toml"],
                       capture_output=True, text=True)
    return p.returncode == 0 and bool(p.stdout.strip())


def test_table_means_spreads_and_counts():
    rows = {"a": [("x", 0.10), ("y", -0.20)], "b": [("x", 0.02), ("y", 0.16)]}
    results = [("c" + sha, sha, [{"config": cfg, "step_err": rows[sha][i][1]}
                                 for i, cfg in enumerate(("x", "y"))], {})
               for sha in ("a", "b")]
    md = rr.table(results).splitlines()
    x = next(line for line in md if line.startswith("| x |"))
    assert x.split(" | ")[1:3] == ["+10.0", "+2.0"]
    assert f"**{100 * statistics.mean([0.10, 0.02]):+.1f}**" in x
    assert f"{100 * statistics.pstdev([0.10, 0.02]):.1f} |" in x
    # within 15 %: a has x (10 %) but not y (20 %); b has x but not y (16 %)
    assert md[-1].startswith("| rows within 15 % | 1 of 2 | 1 of 2 |")


def test_records_must_be_positive():
    with pytest.raises(ValueError, match="--records 0: must be >= 1"):
        rr.records(0)


@pytest.mark.skipif(not _has_history(), reason="needs the git history of benchmarks/results")
def test_newest_record_is_repredicted(tmp_path):
    """The newest record is the one whose rows end tuner_validate.jsonl; every one of its
    configs comes back re-predicted, each error the prediction over the measured step."""
    rows = [json.loads(x) for x in (RESULTS / "tuner_validate.jsonl").read_text().splitlines()]
    newest = rows[-1]["sha"]
    (commit, sha), = rr.records(1)
    assert sha == newest
    rr.main(["--records", "1", "--out", str(tmp_path)])
    got = [json.loads(x) for x in (tmp_path / "tuner_records.jsonl").read_text().splitlines()]
    assert {r["config"] for r in got} == {r["config"] for r in rows if r["sha"] == newest}
    for r in got:
        assert r["record_sha"] == newest and r["record_commit"] == commit[:7]
        assert r["step_err"] == pytest.approx(r["pred_step_s"] / r["meas_step_s"] - 1)
    assert "| rows within 15 % |" in (tmp_path / "tuner_records.md").read_text()


def test_a_record_is_rebuilt_from_its_own_measurements_only(tmp_path, monkeypatch):
    """Where the median platform's probe file names the measurements it was built from
    (`of`), later .m<k> files the commit still holds (an earlier record's) are not used.
    The measurement and raw files are the tracked ones of the latest record."""
    src = {}
    for w in rr.WORLDS:
        toml = RESULTS / rr.PLATFORM.format(w=w, m=".m1")
        raw = toml.with_name(toml.name.replace(".toml", ".raw.json"))
        src[rr.PLATFORM.format(w=w, m="")] = toml.read_text()
        for k in range(1, 6):  # five measurement files at the commit ...
            src[rr.PLATFORM.format(w=w, m=f".m{k}")] = toml.read_text()
            src[rr.PLATFORM.format(w=w, m=f".m{k}").replace(".toml", ".raw.json")] = \
                raw.read_text()
        names = [rr.PLATFORM.format(w=w, m=f".m{k}") for k in (1, 2, 3)]  # ... three its own
        src[rr.PLATFORM.format(w=w, m="").replace(".toml", ".probe.json")] = json.dumps(
            {"probe_s": 0.1, "of": names})
    monkeypatch.setattr(rr, "_show", lambda commit, name: src.get(name))
    assert rr.measurements_of("c", rr.WORLDS[0]) == 3
    how = rr.platforms_of("c", tmp_path)
    assert how == {w: "refitted from 3 measurements" for w in rr.WORLDS}
    assert not list(tmp_path.glob("*.m4.*")) and (tmp_path / rr.PLATFORM.format(w=4, m=".m3")).is_file()
    del src[rr.PLATFORM.format(w=2, m="").replace(".toml", ".probe.json")]  # no list: all five
    assert rr.measurements_of("c", 2) == rr.MAX_MEASUREMENTS
    assert rr.platforms_of("c", tmp_path)[2] == "refitted from 5 measurements"
