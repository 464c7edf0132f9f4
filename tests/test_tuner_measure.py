"""`tuner measure`: the latency/bandwidth fit, the platform file it writes, one real run."""

from __future__ import annotations

import pytest
from conftest import CPU_W2, CPU_W4

from tuner import load_platform
from tuner.measure import (
    GEMM_GRID,
    compute_fields,
    fit_latency_bandwidth,
    measure_platform,
    median_platform,
    sweep_fits,
    write_platform_toml,
)


def test_fit_recovers_latency_and_bandwidth():
    sizes = [2.0**k for k in range(10, 22, 2)]
    times = [5e-6 + s / 3e9 for s in sizes]  # 5 us + 3 GB/s, exactly
    lat, bw = fit_latency_bandwidth(sizes, times)
    assert lat == pytest.approx(5e-6, rel=1e-6) and bw == pytest.approx(3e9, rel=1e-9)
    with pytest.raises(ValueError, match="time does not grow with size"):
        fit_latency_bandwidth([1.0, 2.0], [2.0, 1.0])
    with pytest.raises(ValueError, match="need >= 2"):
        fit_latency_bandwidth([1.0], [1.0])


def test_sweep_fits_each_collective_from_the_median_rank_and_refuse_noise():
    sizes, coll = [1e3, 1e5, 1e7], [1e4, 1e6]

    def rank(extra: float, a2a=None) -> dict:
        line = [1e-4 + extra + s / 1e9 for s in coll]  # 100 us + 1 GB/s (+ this rank's delay)
        return {"a2a": a2a or [2e-5 + s / 2e9 for s in sizes],
                "p2p": [1e-5 + s / 4e9 for s in sizes],
                "coll": {2: {k: line for k in ("all_reduce", "reduce", "broadcast")}}}

    # three ranks, one late by 1 ms: the median rank sets each collective's fit
    colls, a2a, p2p = sweep_fits([rank(0.0), rank(0.0), rank(1e-3)], sizes, coll)
    assert [(k, n) for k, n, _, _ in colls] == [("all_reduce", 2), ("reduce", 2), ("broadcast", 2)]
    for _, _, lat, bw in colls:
        assert lat == pytest.approx(1e-4, rel=1e-6) and bw == pytest.approx(1e9, rel=1e-6)
    assert a2a == pytest.approx((2e-5, 2e9), rel=1e-6)
    assert p2p == pytest.approx((1e-5, 4e9), rel=1e-6)
    # an all-to-all sweep that does not grow with size is noise (measure_platform measures again)
    with pytest.raises(ValueError, match="time does not grow with size"):
        sweep_fits([rank(0.0, a2a=[3e-3, 2e-3, 1e-3])], sizes, coll)


def test_written_file_loads_back(tmp_path):
    p = load_platform("frontier")
    path = write_platform_toml(p, tmp_path / "x.toml", {"peak_tflops": "a note"})
    q = load_platform(path)
    assert "# a note" in path.read_text()
    for f in ("peak_flops", "hbm_bytes", "intra_node_bandwidth", "network_latency"):
        assert getattr(q, f) == pytest.approx(getattr(p, f), rel=1e-5)
    assert (q.gpus_per_node, q.launcher) == (p.gpus_per_node, p.launcher)


def _rank(scale: float) -> dict:
    """A `_compute_worker` result of the quick grid with every rate x `scale` (FLOP/s)."""
    return {"rates": [10.0 * scale, 20.0 * scale], "widths": [5.0 * scale] * 5,
            # 1..7 and 25 (a grid shape beating the reference shapes), last axis (k) fastest
            "grid": [float(i + 1) * scale for i in range(7)] + [25.0 * scale],
            "grouped": 4.0 * scale, "grouped_rows": [2.0 * scale, 16.0 * scale],
            "attn": 6.0 * scale, "attn_grid": [8.0 * scale, 50.0 * scale],
            "copy": 1e9 * scale, "overhead": 1e-3 * scale}


def test_median_platform_takes_each_measured_value_s_median(tmp_path):
    """Three measurements of one machine -> one file: every number the median of the three
    (scalars, the per-shape tables and the collective fits element by element), the first
    file's comments kept; counts that differ are refused, naming the field."""
    import dataclasses

    base = load_platform(CPU_W2)
    files = []
    for i, f in enumerate((1.0, 3.0, 2.0)):
        coll = tuple((kind, n, lat * f, bw / f) for kind, n, lat, bw in base.collectives)
        gt = base.gemm_table
        p = dataclasses.replace(base, peak_flops=base.peak_flops * f,
                                layer_overhead=base.layer_overhead * (4.0 - f),
                                collectives=coll,
                                gemm_table=dataclasses.replace(
                                    gt, values=tuple(v * f / 3 for v in gt.values)))
        files.append(write_platform_toml(p, tmp_path / f"m{i}.toml",
                                         {"peak_tflops": f"note {i}", "gemm_table": "grid"}))
    got = load_platform(median_platform(files, tmp_path / "median.toml"))
    assert got.peak_flops == pytest.approx(base.peak_flops * 2.0, rel=1e-5)
    assert got.layer_overhead == pytest.approx(base.layer_overhead * 2.0, rel=1e-5)
    assert got.gemm_table.values == pytest.approx([v * 2 / 3 for v in base.gemm_table.values],
                                                  rel=1e-3)
    for (kind, n, lat, bw), (k0, n0, lat0, bw0) in zip(got.collectives, base.collectives,
                                                       strict=True):
        assert (kind, n) == (k0, n0)
        assert lat == pytest.approx(lat0 * 2, rel=1e-5) and bw == pytest.approx(bw0 / 2, rel=1e-5)
    assert got.gpus_per_node == base.gpus_per_node and got.name == base.name
    text = (tmp_path / "median.toml").read_text()
    assert text.startswith("# The median of 3 measurements (m0.toml, m1.toml, m2.toml)")
    assert "  # note 0" in text and "# grid\n[gemm_table]" in text
    other = write_platform_toml(dataclasses.replace(base, gpus_per_node=4), tmp_path / "o.toml",
                                {})
    with pytest.raises(ValueError, match="gpus_per_node.*differs"):
        median_platform([files[0], other], tmp_path / "bad.toml")
    with pytest.raises(ValueError, match="no platform files"):
        median_platform([], tmp_path / "bad.toml")


def test_median_platform_prices_each_shape_at_the_median_of_its_measured_rates(tmp_path):
    """Each measurement writes its efficiencies relative to its own peak; the median file's
    efficiency x its (median) peak is the median of the measured rates, not the median
    ratio times the median peak. Three measurements, peak 5 / 10 / 8 (x base / 10), every
    shape measured at 4.5 / 4.0 / 3.0 (efficiency 0.9 / 0.4 / 0.375): the median peak 8 and
    the median rate 4.0 give 0.5, where the median ratio 0.4 would price 3.2. The same for
    the single efficiencies, the width, GEMM, grouped and attention tables. (No clamp is
    needed: each rate is at most its own file's peak, so their median is at most the median
    peak.)"""
    import dataclasses
    import statistics

    base = load_platform(CPU_W2)
    peaks, rates = (5.0, 10.0, 8.0), (4.5, 4.0, 3.0)
    files = []
    for i, (pk, r) in enumerate(zip(peaks, rates, strict=True)):
        e = r / pk
        p = dataclasses.replace(
            base, peak_flops=base.peak_flops * pk / 10, gemm_efficiency=e,
            grouped_gemm_efficiency=e, attention_efficiency=e,
            gemm_width_efficiency=tuple((w, e) for w, _ in base.gemm_width_efficiency),
            **{t: dataclasses.replace(g, values=(e,) * len(g.values))
               for t in ("gemm_table", "grouped_table", "attention_table")
               for g in (getattr(base, t),)})
        files.append(write_platform_toml(p, tmp_path / f"m{i}.toml", {}))
    got = load_platform(median_platform(files, tmp_path / "median.toml"))
    want = statistics.median(rates) / statistics.median(peaks)
    ratios = [r / p for r, p in zip(rates, peaks, strict=True)]
    assert want == 0.5 and statistics.median(ratios) == 0.4
    assert got.peak_flops == pytest.approx(base.peak_flops * 0.8, rel=1e-6)
    for f in ("gemm_efficiency", "grouped_gemm_efficiency", "attention_efficiency"):
        assert getattr(got, f) == pytest.approx(want, rel=1e-6), f
    assert [w for w, _ in got.gemm_width_efficiency] == [w for w, _ in
                                                         base.gemm_width_efficiency]
    assert [e for _, e in got.gemm_width_efficiency] == pytest.approx(
        [want] * len(base.gemm_width_efficiency), rel=1e-6)
    for t in ("gemm_table", "grouped_table", "attention_table"):
        vals = getattr(got, t).values
        assert vals == pytest.approx([want] * len(vals), rel=1e-6), t


def test_compute_fields_medians_and_tables_by_hand():
    # three ranks at 0.5x, 1x, 3x: the median rank (1x) sets every rate
    f = compute_fields([_rank(0.5), _rank(1.0), _rank(3.0)], quick=True)
    assert f["peak_flops"] == 20.0  # best reference shape; the grid does not set it
    assert f["gemm_efficiency"] == 15.0 / 20.0  # median of the 2 shapes / peak
    assert f["grouped_gemm_efficiency"] == 4.0 / 20.0
    g = f["gemm_table"]
    assert g.axes == tuple(tuple(float(v) for v in GEMM_GRID[a][1]) for a in "mnk")
    assert g.values == tuple((i + 1) / 20.0 for i in range(7)) + (1.0,)  # 25 / 20 clamped
    # grid point (m[1], n[0], k[1]) is index 1*4 + 0*2 + 1 = 5 -> rate 6
    assert g.at(g.axes[0][1], g.axes[1][0], g.axes[2][1]) == pytest.approx(6.0 / 20.0)
    assert f["grouped_table"].values == (2.0 / 20.0, 16.0 / 20.0)
    # attention: rates against the full count, stored against the causal half
    assert f["attention_table"].values == (8.0 / 2 / 20.0, 1.0)  # 50 / 2 / 20 clamped at 1
    assert f["hbm_bandwidth"] == 1e9 and f["layer_overhead"] == 1e-3


def test_zero_copy_rate_times_the_trainers_pack_and_unpack():
    """`zero_copy_rate`: bytes of one pass per second over the weights it is given (the
    time of a cat plus one copy_ per tensor for 2 x their bytes), leaving their values."""
    import torch

    from tuner.measure import zero_copy_rate

    ws = [torch.randn(64, 32), torch.randn(128), torch.randn(8, 16, 4)]
    before = [w.clone() for w in ws]
    assert zero_copy_rate(ws, 3) > 0
    assert all(torch.equal(a, b) for a, b in zip(ws, before, strict=True))


def test_loss_rate_times_the_trainers_cross_entropy():
    """`loss_rate`: logit bytes per second of `model.cross_entropy` forward + backward, a
    positive finite rate at any shape (no ratio between shapes is asserted: under the
    parallel test workers one timing moved 27x)."""
    import math

    from tuner.measure import loss_rate

    for shape in ((256, 1024), (64, 50)):
        r = loss_rate(3, *shape)
        assert r > 0 and math.isfinite(r)


def test_call_times_mean_keeps_the_tail_the_median_drops():
    """`call_times` (the small all-reduce's price and `collective_tail`): one call in five
    sleeps 20 ms, the others return at once; the mean of the timed calls carries the slow
    ones (>= 4 ms per call, the sleeps' floor), the median does not (the fast calls are
    16 of 20). The warm-up calls are not timed."""
    import time

    from tuner.measure import call_times

    n = [0]

    def call() -> None:
        n[0] += 1
        if n[0] > 2 and (n[0] - 2) % 5 == 0:
            time.sleep(0.02)

    mean, median = call_times(call, 20, warmup=2)
    assert n[0] == 22
    assert 0.004 <= mean < 0.02  # 4 sleeps of >= 20 ms over 20 calls; far below one each
    assert median < 0.002  # a call that returns at once; the 20 ms sleeps are 4 of 20


@pytest.mark.slow
@pytest.mark.multiproc
def test_quick_measurement_on_this_machine(tmp_path):
    path = measure_platform(tmp_path / "local.toml", n_procs=2, quick=True,
                            raw_out=tmp_path / "local.raw.json")
    p = load_platform(path)
    import json

    from tuner.measure import residual_fields

    raw = json.loads((tmp_path / "local.raw.json").read_text())
    assert raw["n_procs"] == 2 and raw["quick"] is True and len(raw["block_s"]) == 2
    # the fitted fields written are the raw inputs fitted against the file's own entries
    # (2 processes on this machine's cores: the pipeline probe fits the per-action overhead).
    # The file keeps 6 significant digits of every entry, and a fitted field is a difference
    # (measured minus the entries' price), which magnifies that rounding: refitted from the
    # file the elementwise rate moved by 1.5e-4 to 7e-4 (relative) in four runs; 1e-2 bounds it
    for k, v in residual_fields(raw, p).items():
        assert getattr(p, k) == pytest.approx(v, rel=1e-2), k
    assert p.backend == "gloo" and p.gpus_per_node == 2
    # the rank-skew probe's value goes to one of the two fields, by whether the cores are shared
    if p.shares_cores(2):
        assert p.rank_skew == 1.0 and 1.0 <= p.shared_rank_skew < 2.0
    else:
        assert p.shared_rank_skew == 1.0 and 1.0 <= p.rank_skew < 2.0
    assert 1e8 < p.peak_flops < 1e14  # a CPU process: between 0.1 GFLOP/s and 100 TFLOP/s
    assert 0 < p.gemm_efficiency <= 1 and 0 < p.intra_node_bandwidth < 1e12
    assert p.gemm_table is not None and len(p.gemm_table.values) == 8
    assert p.grouped_table is not None and p.attention_table is not None
    # ZeRO's pack / unpack pass: a copy of each byte, so within a few x of the copy rate
    assert 0 < p.zero_copy_bandwidth < 4 * p.hbm_bandwidth
    # the loss: a few passes over the logits (log-softmax, its gradient), below a copy's rate
    assert 0 < p.loss_bandwidth < 4 * p.hbm_bandwidth
    # 8 rows per expert: each expert's [8, 128] x [128, 256] GEMMs are dominated by per-call
    # costs, so they run below 128 rows per expert (16x more work per call)
    assert p.grouped_eff(8, 256, 128) < p.grouped_eff(128, 256, 128)


def _no_hop_platform(**kw):
    """The recorded 4-process platform of this machine with P2P made free (latency 0)."""
    import dataclasses

    p = CPU_W4
    base = dict(intra_node_bandwidth=1e30, intra_node_latency=0.0, cores_per_node=2,
                threads_per_process=1)
    return dataclasses.replace(load_platform(p), **{**base, **kw})


def test_shared_pipeline_factor_by_hand():
    # 1F1B, 2 stages x 2 processes on 2 cores, F = 1 s and B = 2 s at the all-computing rate:
    # whenever a stage waits, the other computes (its dependency), so the cores never idle
    # and the replay ends when all the work is done: 4 processes x 4 micro-batches x 3 s at
    # half a core each = 24 core-seconds on 2 cores = 12 s. A stage computes alone (a core
    # per process, twice the rate) in [0, 0.5] (s0 F0), [1.5, 2.5] (s1 B0), [10.5, 11]
    # (s1 B3's rest) and [11, 12] (s0 B3): 3 s; both stages compute the other 9 s. A measured
    # step of 15 s puts its 3 s beyond the replay on those 9: 1 + 3 / 9
    from tuner.measure import SHARED_FACTOR_FLOOR, pipeline_probe_summary, shared_pipeline_factor

    def rank(step):
        return {"F": [1.0, 1.0, 1.0], "B": [2.0, 2.0, 2.0], "step": [step, 14.0, 16.0]}

    # the step: the median over the first stage's ranks (0, 1) and rounds: 14, 14, 15,
    # 15.5, 16, 16 -> 15.25; the second stage's (ranks 2, 3: 99 s) do not count
    summary = pipeline_probe_summary([rank(15.0), rank(15.5), rank(99.0), rank(99.0)])
    assert summary == {"procs": 4.0, "F0": 1.0, "B0": 2.0, "F1": 1.0, "B1": 2.0, "step": 15.25}
    summary = pipeline_probe_summary([rank(15.0) for _ in range(4)])
    assert summary["step"] == 15.0
    pf = _no_hop_platform()
    assert shared_pipeline_factor(summary, pf) == pytest.approx(4.0 / 3.0, rel=1e-9)
    # priced hand-overs make the replay longer, so the same step is a smaller factor
    slow_p2p = _no_hop_platform(intra_node_latency=0.2)
    assert shared_pipeline_factor(summary, slow_p2p) < 4.0 / 3.0
    # a step shorter than the replay: below 1, floored where the contended part cannot hold it
    assert shared_pipeline_factor({**summary, "step": 7.5}, pf) == pytest.approx(0.5)
    assert shared_pipeline_factor({**summary, "step": 1.0}, pf) == SHARED_FACTOR_FLOOR
    with pytest.raises(ValueError, match="even count"):
        pipeline_probe_summary([rank(15.0) for _ in range(3)])


def test_median_platform_fits_the_fitted_fields_again_against_the_median(tmp_path):
    # three measurements, each consistent in itself: GEMM, attention and overhead prices and
    # the layer times all scaled by s, the fitted fields (residual_fields) fitted against
    # each file's own entries. With s = 0.8, 1.0, 1.3 every measured median is the s = 1
    # file's, so the median platform is that file, fitted fields included; a field-wise
    # median of the fitted fields would mix files
    import dataclasses
    import json

    from tuner.measure import residual_fields

    base = _no_hop_platform(intra_node_latency=1e-3)
    raw0 = {"n_procs": 4, "quick": False, "block_s": [0.05, 0.09, 0.2], "ep_extra_s": 0.02,
            "zero3_extra_s": 0.3, "zero3_opt_extra_s": 0.01,
            "pipeline": {"procs": 4.0, "F0": 0.03, "B0": 0.05, "F1": 0.03, "B1": 0.06,
                         "step": 0.4}}
    paths, raws, fitted = [], [], []
    for k, s in enumerate((1.3, 0.8, 1.0)):
        p = dataclasses.replace(base, peak_flops=base.peak_flops / s,
                                layer_overhead=base.layer_overhead * s,
                                intra_node_latency=base.intra_node_latency * s)
        raw = {**raw0, "block_s": [t * s for t in raw0["block_s"]],
               "ep_extra_s": raw0["ep_extra_s"] * s,
               "pipeline": {**raw0["pipeline"], "step": 0.4 * s}}
        fitted.append(residual_fields(raw, p))
        p = dataclasses.replace(p, **fitted[-1])
        paths.append(write_platform_toml(p, tmp_path / f"p{k}.toml", {}))
        raws.append(tmp_path / f"p{k}.raw.json")
        raws[-1].write_text(json.dumps(raw))
    assert len({f["elementwise_bandwidth"] for f in fitted}) == 3  # the files differ
    got = load_platform(median_platform(paths, tmp_path / "m.toml", raws))
    mid = load_platform(paths[2])
    for field in ("peak_flops", "layer_overhead", "intra_node_latency", *fitted[2]):
        assert getattr(got, field) == pytest.approx(getattr(mid, field), rel=1e-4), field
    assert "fitted again" in (tmp_path / "m.toml").read_text().splitlines()[0]
    # bad inputs: one raw file per platform file, and the pipeline probe in all or none
    with pytest.raises(ValueError, match="one per platform"):
        median_platform(paths, tmp_path / "x.toml", raws[:2])
    (tmp_path / "np.raw.json").write_text(json.dumps({**raw0, "pipeline": None}))
    with pytest.raises(ValueError, match="pipeline probe"):
        median_platform(paths, tmp_path / "x.toml", [*raws[:2], tmp_path / "np.raw.json"])


@pytest.mark.multiproc
def test_pipeline_probe_runs_a_real_pipeline():
    # the probe on 4 gloo processes (2 stages x 2): every rank reports its stage's forward
    # and backward and its own step per round; the factor is a ratio of a real pipeline to
    # its replay, which on any machine lies well inside (0.3, 3)
    from comm import run_local
    from tuner.measure import (
        PIPE_PROBE,
        pipeline_probe_summary,
        pipeline_probe_worker,
        shared_pipeline_factor,
    )

    per_rank = run_local(pipeline_probe_worker, 4, 2, threads=1, timeout_s=300.0)
    assert all(len(r[k]) == 2 for r in per_rank for k in ("F", "B", "step"))
    assert all(t > 0 for r in per_rank for t in r["step"])
    f = [min(r["F"]) for r in per_rank]
    # a step holds every micro-batch's forward of a stage, each no faster than with its
    # stage alone on the cores (2x the all-computing rate)
    assert min(per_rank[0]["step"]) > PIPE_PROBE["microbatches"] * min(f) / 2
    assert 0.3 < shared_pipeline_factor(pipeline_probe_summary(per_rank),
                                        _no_hop_platform()) < 3.0
