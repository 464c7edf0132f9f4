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


def _with_tables(**sections):
    d = load_platform("frontier").to_dict()
    for k in ("gemm_table", "grouped_table", "attention_table", "roofline"):
        d.pop(k, None)
    d.update(sections)
    return Platform.from_dict(d)


def test_fallbacks_without_tables_are_the_single_efficiencies():
    d = load_platform("frontier").to_dict()
    for k in ("gemm_table", "grouped_table", "attention_table", "roofline"):
        d.pop(k, None)
    d["compute"]["gemm_width_efficiency"] = [[64, 0.2], [1024, 0.9]]
    p = Platform.from_dict(d)
    assert p.matmul_eff(4096, 256, 8192) == p.gemm_eff(256)  # min(n, k), as before shapes
    assert p.grouped_eff(16, 2048, 7168) == p.grouped_gemm_efficiency
    assert p.attention_eff(4096, 128, causal=False) == p.attention_efficiency
    assert p.attention_eff(4096, 128, causal=True) == p.attention_efficiency / 2


def test_gemm_table_log_interpolation_by_hand():
    p = _with_tables(gemm_table={
        "m": [64, 256], "n": [128], "k": [16, 64],
        "efficiency": [[[0.2, 0.4]], [[0.6, 0.8]]]})
    assert p.matmul_eff(64, 128, 16) == pytest.approx(0.2)  # grid points
    assert p.matmul_eff(256, 128, 64) == pytest.approx(0.8)
    # m = 128 is half-way from 64 to 256 in log: mean of the m rows; k = 32 likewise
    assert p.matmul_eff(128, 128, 16) == pytest.approx(0.4)
    assert p.matmul_eff(128, 999, 32) == pytest.approx((0.2 + 0.4 + 0.6 + 0.8) / 4)
    # clamped at every end (n has one point: any n)
    assert p.matmul_eff(8, 1, 4) == pytest.approx(0.2)
    assert p.matmul_eff(1e6, 1e6, 1e6) == pytest.approx(0.8)
    # k = 16 * 2**0.5: a quarter of the way in log from 16 to 64
    assert p.matmul_eff(64, 128, 16 * 2**0.5) == pytest.approx(0.25)


def test_grouped_and_attention_tables_by_hand():
    p = _with_tables(
        grouped_table={"rows_per_expert": [8, 512], "efficiency": [0.1, 0.7]},
        attention_table={"seq": [512, 8192], "head_dim": [64, 128],
                         "efficiency": [[0.2, 0.3], [0.5, 0.6]]})
    assert p.grouped_eff(64, 2048, 7168) == pytest.approx(0.4)  # 64 = geometric mean of 8, 512
    assert p.grouped_eff(1, 1, 1) == pytest.approx(0.1) and p.grouped_eff(1e5, 1, 1) == 0.7
    assert p.attention_eff(2048, 128, causal=True) == pytest.approx(0.45)  # 2048 = log mid
    assert p.attention_eff(2048, 128, causal=False) == pytest.approx(0.9)  # full count: 2x


def test_roofline_by_hand():
    d = load_platform("dgx-h100").to_dict()
    for k in ("gemm_table", "grouped_table", "attention_table"):
        d.pop(k, None)
    d["roofline"] = {"max_efficiency": 0.7, "grouped_max_efficiency": 0.6, "bytes_per_element": 2}
    p = Platform.from_dict(d)
    ridge = p.peak_flops / p.hbm_bandwidth  # FLOP per byte where compute takes over
    # [16, 4096] x [4096, 4096]: 2 m n k / (2 (m k + k n + m n)) FLOP per byte
    ai = 2 * 16 * 4096 * 4096 / (2 * (16 * 4096 + 4096 * 4096 + 16 * 4096))
    assert p.matmul_eff(16, 4096, 4096) == pytest.approx(ai / ridge)
    assert p.matmul_eff(8192, 8192, 8192) == 0.7  # far above the ridge: the stated cap
    # grouped: one expert's [r, k] x [k, n] with its weight read for r rows
    ai = 2 * 8 * 2048 * 7168 / (2 * (8 * 7168 + 7168 * 2048 + 8 * 2048))
    assert p.grouped_eff(8, 2048, 7168) == pytest.approx(ai / ridge)
    assert p.grouped_eff(8192, 2048, 7168) == 0.6


@pytest.mark.parametrize("section,body,match", [
    ("gemm_table", {"m": [256, 64], "n": [1], "k": [1], "efficiency": [[[0.5]], [[0.5]]]},
     r"gemm_table.m=\[256.0, 64.0\] must be a non-empty list of ascending distinct values > 0"),
    ("gemm_table", {"m": [64], "n": [1, 2], "k": [1], "efficiency": [[[0.5]]]},
     r"gemm_table.efficiency\[0\] has 1 entries, expected a list of 2 \(one per n\)"),
    ("grouped_table", {"rows_per_expert": [8, 64], "efficiency": [0.5, 1.5]},
     r"grouped_table.efficiency has \[1.5\]; every value must be in \(0, 1\]"),
    ("grouped_table", {"rows_per_expert": [8], "efficiency": [0.5], "n": 3},
     r"\[grouped_table\] has unknown keys \['n'\] / lacks \[\]"),
    ("attention_table", {"seq": [512], "efficiency": [[0.5]]},
     r"\[attention_table\] has unknown keys \[\] / lacks \['head_dim'\]"),
    ("roofline", {"bytes_per_element": 2}, r"\[roofline\] needs max_efficiency in \(0, 1\]"),
    ("roofline", {"max_efficiency": 0}, r"\[roofline\] needs max_efficiency .* got 0"),
    ("roofline", {"max_efficiency": 0.7, "ridge": 3},
     r"unknown keys \['ridge'\] in \[roofline\]"),
    ("roofline", {"max_efficiency": 1.2},
     r"roofline_max_efficiency=1.2 must be in \(0, 1\]"),
])
def test_bad_tables_named(section, body, match):
    with pytest.raises(ValueError, match=match):
        _with_tables(**{section: body})


def test_tables_round_trip_through_the_writer(tmp_path):
    from tuner.measure import write_platform_toml

    p = _with_tables(
        gemm_table={"m": [64, 256], "n": [128], "k": [16, 64],
                    "efficiency": [[[0.2, 0.4]], [[0.6, 0.8]]]},
        grouped_table={"rows_per_expert": [8, 512], "efficiency": [0.1, 0.7]},
        attention_table={"seq": [512], "head_dim": [64, 128], "efficiency": [[0.2, 0.3]]},
        roofline={"max_efficiency": 0.7})
    assert Platform.from_dict(p.to_dict()) == p
    path = write_platform_toml(p, tmp_path / "t.toml", {"gemm_table": "a table note"})
    assert "# a table note\n[gemm_table]" in path.read_text()
    assert load_platform(path) == p


def test_dgx_b200_is_the_datasheet_system_per_gpu():
    """configs/platforms/dgx-b200.toml against the DGX B200 datasheet's *system* figures
    (docs/reference.md section 3), divided over its 8 GPUs: 1,440 GB HBM3e, 64 TB/s, 14.4 TB/s
    aggregate NVLink (both directions), 72 PFLOPS FP8 with 2:4 sparsity (= 2 x dense); BF16
    dense is half of FP8 dense (HGX B200 table); NCCL's planning share of NVLink assumed as
    on the H100 file (370 of 450). Exact arithmetic on the cited values: tight tolerance."""
    b = load_platform("dgx-b200")
    h = load_platform("dgx-h100")
    assert b.gpus_per_node == 8
    assert b.hbm_bytes == pytest.approx(1440e9 / 8)
    assert b.hbm_bandwidth == pytest.approx(64e12 / 8)
    assert b.fp8_peak_flops == pytest.approx(72e15 / 8 / 2)
    assert b.peak_flops == pytest.approx(b.fp8_peak_flops / 2)
    assert b.intra_node_bandwidth == pytest.approx(14.4e12 / 8 / 2 * 370 / 450)
    assert b.nic_bandwidth_per_gpu == pytest.approx(400e9 / 8)
    # the assumed shares are the H100 file's, unchanged
    assert (b.roofline_max_efficiency, b.fp8_max_efficiency, b.fp8_k_half) == \
        (h.roofline_max_efficiency, h.fp8_max_efficiency, h.fp8_k_half)


def test_gpu_platforms_price_by_shape():
    """The shipped GPU files: fine-grained experts (few rows each) below a large GEMM; small
    GEMMs below large ones; flash attention faster per FLOP at long sequences."""
    for name in ("dgx-h100", "dgx-b200", "h200-node", "frontier"):
        p = load_platform(name)
        big = p.matmul_eff(16384, 7168, 7168)
        assert p.matmul_eff(16384, 7168, 7168) >= p.matmul_eff(64, 7168, 7168)
        assert p.grouped_eff(16, 2048, 7168) < p.grouped_eff(4096, 2048, 7168) <= big
        if name != "frontier":  # no per-shape attention source for MI250X: the single value
            assert p.attention_eff(512, 128, True) < p.attention_eff(8192, 128, True) <= 1.0
        # the same attention time under either FLOP count
        assert p.attention_eff(4096, 128, False) == pytest.approx(2 * p.attention_eff(4096, 128, True))


def test_grid_matches_separable_numpy_interpolation():
    """Grid.at (corner weights) against numpy.interp applied one axis at a time in log space
    (an independent route to the same multilinear interpolation, clamped the same way)."""
    import numpy as np

    from tuner.platform import Grid

    rng = np.random.default_rng(0)
    axes = [np.sort(rng.choice(np.arange(1, 5000), n, replace=False)).astype(float)
            for n in (4, 3, 5)]
    vals = rng.uniform(0.05, 1.0, size=[len(a) for a in axes])
    g = Grid.from_nested("gemm_table", ("m", "n", "k"), [list(a) for a in axes], vals.tolist())
    for _ in range(200):
        pt = [float(np.exp(rng.uniform(np.log(0.5 * a[0]), np.log(2 * a[-1])))) for a in axes]
        v = vals
        for d in reversed(range(3)):  # interpolate the last axis first
            la, x = np.log(axes[d]), np.log(pt[d])
            v = np.apply_along_axis(lambda row, la=la, x=x: np.interp(x, la, row), d, v)
        # float sums in another order: agree to rounding
        assert g.at(*pt) == pytest.approx(float(v), rel=1e-12, abs=1e-15)
