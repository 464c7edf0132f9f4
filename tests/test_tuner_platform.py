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


def test_gemm_efficiency_by_width_by_hand(tmp_path):
    d = load_platform("frontier").to_dict()
    assert Platform.from_dict(d).gemm_eff(128) == d["compute"]["gemm_efficiency"]  # no table
    d["compute"]["gemm_width_efficiency"] = [[64, 0.2], [256, 0.6], [1024, 0.9]]
    d["compute"]["layer_overhead_us"] = 1500.0
    p = Platform.from_dict(d)
    assert p.layer_overhead == pytest.approx(1.5e-3)
    # log2 interpolation: 128 is half-way from 64 to 256 -> 0.4; 512 half-way to 1024 -> 0.75
    assert p.gemm_eff(128) == pytest.approx(0.4) and p.gemm_eff(512) == pytest.approx(0.75)
    assert p.gemm_eff(16) == 0.2 and p.gemm_eff(4096) == 0.9  # clamped at the ends
    from tuner.measure import write_platform_toml

    back = load_platform(write_platform_toml(p, tmp_path / "w.toml", {}))
    assert back.gemm_width_efficiency == ((64, 0.2), (256, 0.6), (1024, 0.9))
    d["compute"]["gemm_width_efficiency"] = [[256, 0.6], [64, 0.2]]
    with pytest.raises(ValueError, match="ascending distinct widths"):
        Platform.from_dict(d)
    d["compute"]["gemm_width_efficiency"] = []
    d["compute"]["layer_overhead_us"] = -1.0
    with pytest.raises(ValueError, match="layer_overhead=-1e-06 must be >= 0"):
        Platform.from_dict(d)
