"""Training across an emulated 2-node cluster (network namespaces, shaped 1 Gbit/s NICs).

EP=4 spans both nodes, so every MoE exchange crosses the emulated network; HALO (topology
discovered from the namespaces) and `auto` (cost model calibrated on the emulated links at
start-up, then a per-exchange choice) must give the flat all-to-all's losses (rel 1e-6).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from conftest import ROOT, netns_works

from comm.tools.emulate import leftovers

pytestmark = [pytest.mark.netns, pytest.mark.multiproc]




@pytest.mark.skipif(not netns_works(), reason="needs root, iproute2 and tc (ip netns)")
@pytest.mark.parametrize("algos", [
    # both slow (CI time: ~45 s a run on 2 cores). The default tier covers the parts: discovery
    # from the namespaces and auto/halo exchanges on an emulated cluster in test_comm_emulate
    # (comm.selfcheck), HALO training equal to flat on a declared topology in
    # test_trainer_distributed
    pytest.param(("flat", "auto"), marks=pytest.mark.slow),
    pytest.param(("flat", "halo"), marks=pytest.mark.slow),
], ids=["auto", "halo"])
def test_halo_equals_flat_on_emulated_cluster(tmp_path, algos):
    data = tmp_path / "d.txt"
    data.write_bytes(b"".join(p.read_bytes() for p in sorted((ROOT / "trainer").glob("*.py"))))
    losses = {}
    for algo in algos:
        out = tmp_path / algo
        cmd = [sys.executable, "-m", "comm.emulate", "--nodes", "2", "--gpus-per-node", "2",
               "--nic-mbit", "1000", "--timeout-s", "400", "--", "train.py", "--config",
               "configs/tiny-ep-dp.toml", "--parallel.ep=4", f"--comm.alltoall={algo}",
               "--train.steps=4", "--train.seq_len=64", "--train.global_batch=8",
               "--train.eval_batches=1", "--train.plot=false", f"--data={data}",
               f"--train.out_dir={out}"]
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                text=True, env=dict(os.environ, OMP_NUM_THREADS="1"))
        try:
            stdout, stderr = proc.communicate(timeout=600)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.communicate()
        r = subprocess.CompletedProcess(cmd, proc.returncode, stdout, stderr)
        assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-4000:]
        # the emulator names its namespaces and links after its own pid: none may remain
        # (other emulated clusters running on the machine at the same time are not ours)
        assert leftovers(f"pmoe-{proc.pid}") == [], leftovers(f"pmoe-{proc.pid}")
        if algo != "flat":
            assert "Topology: 4 ranks on 2 nodes" in r.stdout  # discovered from the namespaces
        if algo == "auto":
            assert "calibrated in" in r.stdout, r.stdout[-2000:]
        rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
        losses[algo] = [x["loss"] for x in rows if "loss" in x]
    assert len(losses["flat"]) == 4
    for algo in algos[1:]:
        assert losses[algo] == pytest.approx(losses["flat"], rel=1e-6), algo
