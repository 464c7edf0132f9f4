"""`python -m comm.netsim`: sizes, JSON rows, and numbers equal to the closed form."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from comm.netsim.cli import main, parse_size
from tests.conftest import ROOT


def test_parse_size():
    assert parse_size("4096") == 4096
    assert parse_size("256K") == 256 << 10
    assert parse_size("1MiB") == 1 << 20
    assert parse_size("2g") == 2 << 30
    with pytest.raises(ValueError, match="byte count"):
        parse_size("lots")


def test_cli_emulator_rows_match_nic_bound(tmp_path, capsys):
    """4 emulated nodes x 2 ranks at 100 Mbit/s: each NIC sends 2 * 6 messages of b."""
    out = tmp_path / "rows.jsonl"
    assert main(["--topology", "emulator", "--nodes", "2", "4", "--ranks-per-node", "2",
                 "--bytes", "256K", "--json", str(out)]) == 0
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [(r["nodes"], r["algo"]) for r in rows] == [(2, "flat"), (2, "halo"),
                                                       (4, "flat"), (4, "halo")]
    for r in rows:
        expect = 2 * (r["nodes"] - 1) * 2 * (256 << 10) / 12.5e6
        assert r["time_s"] == pytest.approx(expect, rel=1e-9)
    assert "flat time / HALO time" in capsys.readouterr().out


@pytest.mark.integration
def test_module_entry_point_runs():
    proc = subprocess.run([sys.executable, "-m", "comm.netsim", "--topology", "frontier",
                           "--nodes", "2", "--bytes", "64K", "--no-lump"],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "frontier" in proc.stdout and "halo" in proc.stdout


def test_cli_rejects_unknown_algorithm():
    with pytest.raises(SystemExit):
        main(["--algos", "ring"])
