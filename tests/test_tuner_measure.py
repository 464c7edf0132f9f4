"""`tuner measure`: the latency/bandwidth fit, the platform file it writes, one real run."""

from __future__ import annotations

import pytest

from tuner import load_platform
from tuner.measure import fit_latency_bandwidth, measure_platform, write_platform_toml


def test_fit_recovers_latency_and_bandwidth():
    sizes = [2.0**k for k in range(10, 22, 2)]
    times = [5e-6 + s / 3e9 for s in sizes]  # 5 us + 3 GB/s, exactly
    lat, bw = fit_latency_bandwidth(sizes, times)
    assert lat == pytest.approx(5e-6, rel=1e-6) and bw == pytest.approx(3e9, rel=1e-9)
    with pytest.raises(ValueError, match="time does not grow with size"):
        fit_latency_bandwidth([1.0, 2.0], [2.0, 1.0])
    with pytest.raises(ValueError, match="need >= 2"):
        fit_latency_bandwidth([1.0], [1.0])


def test_written_file_loads_back(tmp_path):
    p = load_platform("frontier")
    path = write_platform_toml(p, tmp_path / "x.toml", {"peak_tflops": "a note"})
    q = load_platform(path)
    assert "# a note" in path.read_text()
    for f in ("peak_flops", "hbm_bytes", "intra_node_bandwidth", "network_latency"):
        assert getattr(q, f) == pytest.approx(getattr(p, f), rel=1e-5)
    assert (q.gpus_per_node, q.launcher) == (p.gpus_per_node, p.launcher)


@pytest.mark.slow
@pytest.mark.multiproc
def test_quick_measurement_on_this_machine(tmp_path):
    path = measure_platform(tmp_path / "local.toml", n_procs=2, quick=True)
    p = load_platform(path)
    assert p.backend == "gloo" and p.gpus_per_node == 2
    assert 1e8 < p.peak_flops < 1e14  # a CPU process: between 0.1 GFLOP/s and 100 TFLOP/s
    assert 0 < p.gemm_efficiency <= 1 and 0 < p.intra_node_bandwidth < 1e12
