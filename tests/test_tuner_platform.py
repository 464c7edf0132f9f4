"""Platform files: published values load in SI units; bad names and keys fail clearly."""

from __future__ import annotations

import tomllib

import pytest

from tuner import Platform, load_platform, platform_names


def test_published_platforms_load():
    assert {"frontier", "dgx-h100", "h200-node"} <= set(platform_names())
    f = load_platform("frontier")
    assert f.peak_flops == pytest.approx(191.5e12)
    assert f.hbm_bytes == pytest.approx(64e9)
    assert f.gemm_efficiency == pytest.approx(0.60)
    assert f.nic_bandwidth_per_gpu == pytest.approx(4 * 25e9 / 8)
    assert f.max_ep == 8 * 4  # EP inside one switch: 4 nodes x 8 GCDs
    h = load_platform("h200-node")
    assert h.hbm_bytes == pytest.approx(141e9) and h.hbm_bandwidth == pytest.approx(4.8e12)
    assert h.peak_flops == pytest.approx(989e12) and h.nic_bandwidth_per_gpu == pytest.approx(50e9)
    assert load_platform("dgx-h100").hbm_bytes == pytest.approx(80e9)


def test_round_trip_and_path(tmp_path):
    f = load_platform("frontier")
    assert Platform.from_dict(f.to_dict()) == f
    p = tmp_path / "mine.toml"
    p.write_text((load_platform.__globals__["PLATFORM_DIR"] / "frontier.toml").read_text())
    assert load_platform(p) == f
    assert tomllib.loads(p.read_text())["name"] == "frontier"


def test_unknown_platform_lists_files():
    with pytest.raises(ValueError, match="unknown platform 'summit'; valid: .*frontier"):
        load_platform("summit")


def test_bad_values_rejected():
    d = load_platform("frontier").to_dict()
    d["compute"]["gemm_efficiency"] = 1.5
    with pytest.raises(ValueError, match=r"gemm_efficiency=1.5 must be in \(0, 1\]"):
        Platform.from_dict(d)
    d = load_platform("frontier").to_dict()
    d["node"]["gpus_per_nod"] = 8
    with pytest.raises(ValueError, match="unknown keys \\['gpus_per_nod'\\] in \\[node\\]"):
        Platform.from_dict(d)
