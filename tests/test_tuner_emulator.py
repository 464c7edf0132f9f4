"""The emulated cluster's platform (`tuner.measure.emulator_platform`), the layer + fb pricing
of `tuner.costs.a2a_exposed`, and the pure parts of benchmarks/bench_tuner_emulator.py (row
grouping, the job it predicts). Fast: no emulator, no training."""

from __future__ import annotations

import dataclasses
import functools
import json
import re
import sys
from pathlib import Path

import pytest
from conftest import CPU_W4

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

import bench_tuner_emulator as b  # noqa: E402

from tuner import ParallelPlan, load_platform  # noqa: E402
from tuner.costs import a2a_exposed  # noqa: E402
from tuner.measure import (  # noqa: E402
    emulator_payload_share,
    emulator_platform,
    parse_emulator_shape,
    write_emulator_platform,
)

# A row as bench_moe_overlap.py writes it (the tracked record's first row, d86e4ee)
ROW = {"bench": "moe_overlap", "git_sha": "d86e4ee", "nodes": 2, "gpus_per_node": 2,
       "nic_mbit": 200.0, "arm": "flat/none", "alltoall": "flat", "a2a_overlap": "none",
       "a2a_chunks": 1, "experts": 16, "top_k": 4, "steps": 6, "step_s": 2.776,
       "exchange_s": 0.9456, "remote_bytes": 16776704.0, "repeat": 0}


def local4():
    # measured on this VM with 4 processes, frozen in tests/data (configs/platforms/local.toml
    # is re-measured, and its per-message latency, 1-2 ms, moves the ~2 % the exchange test
    # below allows for)
    return load_platform(str(CPU_W4))


def test_payload_share_matches_the_emulators_stated_and_measured_share():
    # comm/tools/emulate.py states "at most 0.956 of the rate is TCP payload" at MTU 1500 and
    # netsim_validate.md measured 0.956 (duplex goodput / shaped rate): 3 digits -> 5e-4
    assert emulator_payload_share(1500) == pytest.approx(0.956, abs=5e-4)
    # jumbo frames: "~1 %" of the link in headers (same docstring)
    assert 0.985 < emulator_payload_share(9000) < 0.995
    with pytest.raises(ValueError):
        emulator_payload_share(100)


def test_parse_shape():
    assert parse_emulator_shape("2x2@200") == (2, 2, 200.0)
    assert parse_emulator_shape("4x2@1000") == (4, 2, 1000.0)
    for bad in ("2x2", "2@200", "0x2@200", "2x2@-1", "axb@c"):
        with pytest.raises(ValueError):
            parse_emulator_shape(bad)


def test_emulator_platform_link_from_parameters_compute_from_base():
    base = local4()
    pf = emulator_platform(base, 2, 2, 200.0)
    assert (pf.gpus_per_node, pf.nics_per_node) == (2, 1)
    # 200 Mbit/s = 25e6 B/s on the wire, 1448 of every 1514 bytes payload
    assert pf.nic_bandwidth == pytest.approx(25e6 * 1448 / 1514, rel=1e-12)
    assert pf.network_latency == base.network_latency  # no --latency-ms: no netem delay
    for f in ("peak_flops", "gemm_efficiency", "grouped_gemm_efficiency", "hbm_bandwidth",
              "layer_overhead", "intra_node_bandwidth", "intra_node_latency", "cores_per_node"):
        assert getattr(pf, f) == getattr(base, f), f
    # measured collective fits only for groups inside one emulated node (2 ranks)
    assert all(c[1] <= 2 for c in pf.collectives)
    # netem on both ends of the veth: 2 L one way; 2 (n - 1) ring steps of the small all-reduce
    lat = emulator_platform(base, 2, 2, 200.0, latency_ms=1.5)
    assert lat.network_latency == pytest.approx(base.network_latency + 3e-3)
    assert lat.sync_latency == pytest.approx(base.sync_latency + 6 * 3e-3)
    # a pair's syncs: the base's pair price on one node; across nodes (a pair may span two)
    # none measured, so the whole group's
    paired = dataclasses.replace(base, pair_sync_latency=2e-3)
    assert emulator_platform(paired, 1, 4, 200.0).pair_sync_latency == 2e-3
    assert emulator_platform(paired, 2, 2, 200.0).pair_sync_latency == 0.0
    with pytest.raises(ValueError, match="--procs 8"):
        emulator_platform(base, 4, 2, 200.0)  # an 8-process emulator needs an 8-process base


def test_written_platform_file_loads_back(tmp_path):
    path = write_emulator_platform(local4(), tmp_path / "emu.toml", 2, 2, 1000.0)
    pf = load_platform(path)
    assert pf.nic_bandwidth == pytest.approx(125e6 * 1448 / 1514, rel=1e-5)  # 6 digits written
    assert (pf.gpus_per_node, pf.nics_per_node) == (2, 1)


def test_flat_exchange_prices_the_rows_inter_node_bytes():
    """Independent count: the row's remote_bytes is what every rank's forward dispatch sent to
    the other node in a step (the dispatcher's plan). With balanced routing the NIC-bound
    forward (dispatch + combine, each node's half of those bytes each way) takes
    remote_bytes / nodes x 2 / nic rate; the model's forward all-to-all (half of the step's,
    no overlap) adds the per-message latencies and gloo's serial intra-node step: within 5 %
    (they are ~2 % at 2x2@200: 12 messages x ~1 ms of intra-node latency against 0.70 s)."""
    # the EP path's fixed host cost (ep_layer_overhead, measured) is booked with the
    # all-to-all too; this test is about the bytes
    pf = dataclasses.replace(emulator_platform(local4(), 2, 2, 200.0), ep_layer_overhead=0.0)
    row = {**ROW, "imbalance": 1.0}
    pred_fwd = b.predict(row, pf)["alltoall_s"] / 2
    nic_bound = ROW["remote_bytes"] / 2 * 2 / pf.nic_bandwidth
    assert pred_fwd == pytest.approx(nic_bound, rel=0.05)
    assert pred_fwd > nic_bound  # latencies only add


def test_row_grouping_and_job():
    rows = [ROW, {**ROW, "repeat": 1, "step_s": 2.78}, {**ROW, "arm": "flat/fb/2",
            "a2a_overlap": "fb", "a2a_chunks": 2, "microbatches": 2},
            {**ROW, "git_sha": "a5d7bd2", "microbatches": 1}]
    g = b.group_rows(rows)
    assert [len(v) for v in g.values()] == [2, 1, 1]  # no microbatches field means 1
    cfg, plan, asm = b.job(rows[2])
    assert (plan.ep, plan.dp, plan.pp, plan.microbatches) == (4, 1, 1, 2)
    assert (plan.alltoall, plan.a2a_overlap, asm.a2a_chunks) == ("flat", "fb", 2)
    assert (cfg.n_routed_experts, cfg.top_k) == (16, 4)
    assert asm.routing_imbalance == b.JOB_IMBALANCE
    assert b.job({**ROW, "imbalance": 1.2})[2].routing_imbalance == 1.2


def test_read_rows_skips_other_benches(tmp_path):
    p = tmp_path / "r.jsonl"
    p.write_text(json.dumps(ROW) + "\n\n" + json.dumps({"bench": "other", "step_s": 1}) + "\n")
    assert b.read_rows(p) == [ROW]


def test_compare_skips_shapes_without_a_base():
    res, skipped = b.compare([ROW, {**ROW, "nodes": 4}], {4: local4()})
    assert len(res) == 1 and len(skipped) == 1 and "8 processes" in skipped[0]
    assert res[0]["step_err"] == pytest.approx(res[0]["pred_step_s"] / ROW["step_s"] - 1)


def test_layer_plus_fb_pricing_by_hand():
    """a2a_exposed for fb with chunks: each micro-batch first hides its chunked exchange as
    the layer mode does, the paired ones then behind the other micro-batch's 3 f + rec."""
    def t(nbytes: float) -> float:
        return 1e-3 + nbytes / 1e6  # 1 ms per message, 1 MB/s

    a2a = functools.partial(t)
    parts = {"gemm": 0.01, "router": 0.0, "attn_core": 0.01, "experts": 0.04, "dense": 0.02}
    ab = (1e5, 1e5)
    plan = ParallelPlan(pp=1, ep=4, dp=1, microbatches=2, global_batch=16, seq_len=256,
                        a2a_overlap="fb")
    A2 = 2 * (t(5e4) + t(5e4))  # 0.204 per pass at 2 chunks
    X = 0.02 + 0.04 / 2
    own = (A2 - X) + (A2 - 2 * X)  # forward, backward
    f = sum(parts.values())
    paired = 0.5  # m = 2, pp = 1: one of two micro-batches pairs
    want = paired * max(own - 3 * f, 0.0) + (1 - paired) * own
    got, total = a2a_exposed(plan, parts, 0.0, ab, a2a, chunks=2)
    assert got == pytest.approx(want, rel=1e-12)
    assert total == pytest.approx(2 * (t(1e5) + t(1e5)))
    # fb alone (chunks 1, and auto = 1 as the trainer resolves it) is the old formula
    fb1 = paired * max(total - 3 * f, 0.0) + (1 - paired) * total
    assert a2a_exposed(plan, parts, 0.0, ab, a2a, chunks=1)[0] == pytest.approx(fb1)
    assert a2a_exposed(plan, parts, 0.0, ab, a2a, chunks=0)[0] == pytest.approx(fb1)
    assert got < fb1  # chunking inside the micro-batches hides more
    layer = dataclasses.replace(plan, a2a_overlap="layer")
    assert got < a2a_exposed(layer, parts, 0.0, ab, a2a, chunks=2)[0]


def test_imbalance_comes_from_rows_of_the_same_router():
    """The imbalance depends on the EP size, experts and top-k only: a measured row of that
    router sets it for every arm and network; EP 8 without one is skipped, not guessed."""
    ep8 = {**ROW, "nodes": 4}
    assert b.imbalances([ROW])[(4, 16, 4)] == b.JOB_IMBALANCE
    got = b.imbalances([ROW, {**ep8, "imbalance": 2.0}, {**ep8, "imbalance": 2.4}])
    assert got[(8, 16, 4)] == pytest.approx(2.2)
    res, skipped = b.compare([ep8], {8: dataclasses.replace(local4(), gpus_per_node=8)})
    assert not res and "no measured imbalance" in skipped[0]
    res, _ = b.compare([{**ROW, "nic_mbit": 1000.0}], {4: local4()})
    assert res[0]["imbalance"] == b.JOB_IMBALANCE  # the network does not change the routing


def test_run_spec_parses_and_names_bad_ones():
    assert b.parse_run_spec("2x2@200:dedup/none:1") == ("2x2@200", "dedup/none", 1, 16, 4)
    assert b.parse_run_spec("4x2@1000:flat/fb/2:2:64:8") == ("4x2@1000", "flat/fb/2", 2, 64, 8)
    for bad, msg in (("2x2@200:flat/none", "need SETUP:ARM:M"),
                     ("2x2@200:flat/none:1:64", "need SETUP:ARM:M"),
                     ("2x2@200:flat/none:x", "must be integers"),
                     ("2x2@200:flat/none:1:8:16", "1 <= TOPK <= EXPERTS"),
                     ("2x2@200:flat/none:0", "M >= 1")):
        with pytest.raises(ValueError, match=msg):
            b.parse_run_spec(bad)


def test_rows_with_their_own_base_are_predicted_from_it(tmp_path):
    """A --measure-base row names the platform measured just before it; compare predicts it
    from that file, not from the invocation's base, and a named file that is missing or of
    another process count is an error, never a silent fallback."""
    fast = dataclasses.replace(local4(), peak_flops=2 * local4().peak_flops)
    from tuner.measure import write_platform_toml

    write_platform_toml(fast, tmp_path / "w4.fast.toml", {})
    own = {**ROW, "base_platform": "w4.fast.toml"}
    plain, _ = b.compare([ROW], {4: local4()}, [tmp_path])
    got, _ = b.compare([own], {4: local4()}, [tmp_path])
    want, _ = b.compare([ROW], {4: load_platform(tmp_path / "w4.fast.toml")}, [tmp_path])
    assert got[0]["pred_step_s"] == pytest.approx(want[0]["pred_step_s"], rel=1e-12)
    assert got[0]["pred_step_s"] < plain[0]["pred_step_s"]  # the faster compute took effect
    assert got[0]["base_platform"] == "w4.fast.toml"
    # no invocation base of that size needed when the row brings its own
    assert len(b.compare([own], {}, [tmp_path])[0]) == 1
    with pytest.raises(FileNotFoundError, match="w4.gone.toml"):
        b.compare([{**ROW, "base_platform": "w4.gone.toml"}], {4: local4()}, [tmp_path])
    with pytest.raises(ValueError, match="describes 4 processes, the run had 8"):
        b.compare([{**own, "nodes": 4}], {}, [tmp_path])


def test_measure_base_needs_run():
    with pytest.raises(SystemExit, match="give --run"):
        b.main(["--measure-base", "--out", "/nonexistent-not-created"])


def test_bench_reads_what_auto_ran_from_the_trainers_log(capsys):
    """bench_moe_overlap's `auto_picks` on the trainer's own lines: resolve_a2a's rule lines,
    then a StepTrial's decision overriding them, and the trial's length."""
    import dataclasses as dc
    from types import SimpleNamespace

    import bench_moe_overlap
    import torch

    from comm.topology import Topology
    from model import presets
    from trainer.a2a_trial import StepTrial
    from trainer.build import resolve_a2a
    from trainer.config import parse_args
    from trainer.layout import Layout

    cfg = parse_args(["--comm.alltoall=auto", "--comm.a2a_overlap=auto", "--parallel.ep=4"])
    mesh = SimpleNamespace(ep=4, tp=1, pp=1, rank=0, layout=Layout(4, ep=4))
    resolve_a2a(cfg, dc.replace(presets.get("tiny"), top_k=4), mesh, Topology.uniform(2, 2))
    rules = capsys.readouterr().out
    assert bench_moe_overlap.auto_picks(rules) == {
        "picked_alltoall": "dedup", "picked_overlap": "layer", "picked_chunks": "2"}
    disp = SimpleNamespace(algorithm="dedup", overlap="layer", chunks=2)
    cands = [("dedup", "layer", 2), ("flat", "none", 1)]
    trial = StepTrial([disp], cands, 1, torch.device("cpu"))
    msg = None
    for s in (1.0, 2.0, 1.5):
        trial.before_step()
        msg = trial.after_step(s) or msg
    log = (rules + "comm.alltoall / a2a_overlap=auto: the next 3 steps try dedup/layer/2, "
           "flat/none (1 rounds after one uncounted step; --comm.auto_trial)\n" + msg + "\n")
    got = bench_moe_overlap.auto_picks(log)
    assert got == {"picked_alltoall": "flat", "picked_overlap": "none", "picked_chunks": "1",
                   "trial_steps": 3, "auto_trial": msg.split(": ", 1)[1]}


def test_rows_without_a_base_take_the_stored_one_nearest_their_time(tmp_path):
    """A row measured before --measure-base existed is predicted from the stamped base of its
    process count nearest its time (either side, within NEAREST_BASE_H), else from the
    invocation's base; the result says which."""
    from tuner.measure import write_platform_toml

    fast = dataclasses.replace(local4(), peak_flops=2 * local4().peak_flops)
    slow = dataclasses.replace(local4(), peak_flops=local4().peak_flops / 2)
    write_platform_toml(fast, tmp_path / "tuner_emulator_platform_w4.20261206T050000.toml", {})
    write_platform_toml(slow, tmp_path / "tuner_emulator_platform_w4.20261206T033000.toml", {})
    # an 8-process stamp nearer in time, and a name that is not a stamp: neither is a candidate
    write_platform_toml(slow, tmp_path / "tuner_emulator_platform_w8.20261206T043000.toml", {})
    write_platform_toml(slow, tmp_path / "tuner_emulator_platform_w4.fast.toml", {})
    stored = b.stored_bases([tmp_path])
    assert sorted(n for n in stored) == [4, 8] and len(stored[4]) == 2
    row = {**ROW, "time": "2026-12-06T04:20:00"}  # 40 min before the fast one, 50 after the slow
    assert b.nearest_base(row, stored) == "tuner_emulator_platform_w4.20261206T050000.toml"
    assert b.nearest_base({**ROW, "time": "2026-12-06T03:40:00"}, stored).endswith("T033000.toml")
    assert b.nearest_base({**ROW, "time": "2026-12-06T09:00:00"}, stored) is None  # 4 h away
    assert b.nearest_base({k: v for k, v in ROW.items() if k != "time"}, stored) is None

    got, _ = b.compare([row], {4: local4()}, [tmp_path])
    # ROW has no time: the invocation's base, here the same file loaded
    want, _ = b.compare([ROW], {4: load_platform(
        tmp_path / "tuner_emulator_platform_w4.20261206T050000.toml")}, [tmp_path])
    assert got[0]["pred_step_s"] == pytest.approx(want[0]["pred_step_s"], rel=1e-12)
    assert (got[0]["base_rule"], want[0]["base_rule"]) == ("nearest", "default")
    assert b._base_label(got[0]) == "nearest 20261206T050000"
    # a row's own base still wins over a nearer stamped one
    own, _ = b.compare([{**row, "base_platform": "tuner_emulator_platform_w4.20261206T033000.toml"}],
                       {4: local4()}, [tmp_path])
    assert own[0]["base_rule"] == "own" and own[0]["pred_step_s"] > got[0]["pred_step_s"]


def test_quiet_repeated_leaves_out_single_runs_and_loaded_records():
    res = [{"repeats": 2, "measured_sha": "ca9dc75"}, {"repeats": 1, "measured_sha": "ca9dc75"},
           {"repeats": 3, "measured_sha": "a5d7bd2"}]
    assert b.quiet_repeated(res) == [res[0]]


def test_default_base_is_the_frozen_copy_not_the_records_file(tmp_path, capsys):
    """main's default --base is tuner_emulator_platform_w4.toml (a frozen copy), not the
    local validation record's file, which every record replaces."""
    rows = tmp_path / "rows.jsonl"
    rows.write_text(json.dumps(ROW) + "\n")  # no time: predicted from the default base
    assert b.main(["--rows", str(rows), "--out", str(tmp_path / "out")]) == 0
    md = (tmp_path / "out" / "tuner_emulator.md").read_text()
    assert "on tuner_emulator_platform_w4.toml;" in md and "tuner_validate" not in md
    got = json.loads((tmp_path / "out" / "tuner_emulator.jsonl").read_text().splitlines()[0])
    frozen = ROOT / "benchmarks" / "results" / "tuner_emulator_platform_w4.toml"
    want, _ = b.compare([ROW], {4: load_platform(frozen)}, [])
    assert got["pred_step_s"] == pytest.approx(want[0]["pred_step_s"], rel=1e-12)
    # one arm, a single run of a loaded-VM record: counted in the first line only
    assert re.search(r"\n[01] of 1 arms within 20%\.\n", md)
    assert "\n0 of 0 arms measured with >= 2 repeats" in md
