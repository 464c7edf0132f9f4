"""Training with the overlapped and the deduplicated expert all-to-all equals the plain run.

EP = 4 over two declared nodes of two ranks (configs/topologies/2x2-local.toml), top-4 of 8
experts with a shared expert, fp32 on CPU, 20 steps. Against the plain flat exchange: the
chunk pipeline runs the same row computations in chunks (expert-weight gradients are summed
per chunk, then added), dedup adds a token's expert outputs per node first; both change only
the summation order, ~1e-7 relative per op, which 20 AdamW steps amplify to ~1e-6 (the EP
vs one-process test's drift is of that size). The issue asks rel 1e-5; a misrouted or lost
row would move the first step's loss by far more.
"""

from __future__ import annotations

import re

import pytest
from conftest import run_train, step_losses, train_ok

pytestmark = [pytest.mark.multiproc, pytest.mark.integration, pytest.mark.slow]

COMMON = ["--config", "configs/tiny-ep-dp.toml", "--train.seq_len=64", "--train.global_batch=8",
          "--model.d_model=64", "--model.moe_ffn_dim=64", "--model.top_k=4",
          "--model.shared_ffn_dim=32", "--train.eval_every=0", "--train.eval_batches=2",
          "--optim.warmup_steps=5", "--train.plot=false", "--parallel.ep=4", "--train.steps=20",
          "--comm.topology=configs/topologies/2x2-local.toml"]


@pytest.fixture(scope="module")
def plain(tmp_path_factory, small_data):
    out = tmp_path_factory.mktemp("plain")
    train_ok([*COMMON, "--data", small_data, "--comm.alltoall=flat",
              "--comm.a2a_overlap=none"], out, 4)
    return step_losses(out)


@pytest.mark.parametrize("extra", [
    ["--comm.alltoall=flat", "--comm.a2a_overlap=layer", "--comm.a2a_chunks=3"],
    ["--comm.alltoall=dedup", "--comm.a2a_overlap=none"],
    ["--comm.alltoall=dedup", "--comm.a2a_overlap=layer", "--comm.a2a_chunks=2"],
    ["--comm.alltoall=auto", "--comm.a2a_overlap=auto", "--comm.a2a_chunks=auto"],
], ids=["flat-layer3", "dedup", "dedup-layer2", "auto"])
def test_losses_equal_plain(tmp_path, small_data, plain, extra):
    out = tmp_path / "run"
    r = run_train([*COMMON, "--data", small_data, *extra, f"--train.out_dir={out}"], nproc=4)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-5000:]
    got = step_losses(out)
    assert sorted(got) == sorted(plain) == list(range(1, 21))
    for s in plain:
        assert got[s] == pytest.approx(plain[s], rel=1e-5), (s, plain[s], got[s])
    if "auto" in extra[0]:  # auto tries its choices over the first steps, runs the fastest
        # the rules (dedup at 0.55x the bytes; layer: fb's memory is not known here) first
        assert "the next 13 steps try dedup/layer/2, dedup/none, auto/layer/2, auto/none, " \
               "flat/layer/2, flat/none" in r.stdout, r.stdout[-3000:]
        m = re.search(r"auto: trial over 12 steps .*?: (.*); runs (\S+) from here\n", r.stdout)
        assert m, r.stdout[-3000:]
        secs = {name: float(v) for name, v in re.findall(r"(\S+) ([\d.]+) s \(", m.group(1))}
        assert len(secs) == 6 and secs[m.group(2)] == min(secs.values()), (m.group(2), secs)


def test_a_resumed_run_keeps_the_trial_pick(tmp_path, small_data, plain):
    """auto's trial over steps 1-7 (one round of its 6 choices), a stop after step 10, a
    resume to 20: the resumed run keeps the pick the checkpoint recorded (no second trial),
    and the losses are the plain run's (every choice computes the same rows)."""
    out = tmp_path / "run"
    args = [*COMMON, "--data", small_data, "--comm.alltoall=auto", "--comm.a2a_overlap=auto",
            "--comm.auto_trial=1", f"--train.out_dir={out}"]
    r = run_train([*args, "--train.stop_after=10"], nproc=4)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-5000:]
    m = re.search(r"auto: trial over 6 steps .*?; runs (\S+) from here\n", r.stdout)
    assert m, r.stdout[-3000:]
    r2 = run_train([*args, "--resume"], nproc=4)
    assert r2.returncode == 0, r2.stdout[-3000:] + r2.stderr[-5000:]
    assert f"keeps {m.group(1)}, the pick of the trial recorded in the checkpoint (ended at " \
           f"step 7" in r2.stdout, r2.stdout[-3000:]
    assert "steps try" not in r2.stdout and "trial over" not in r2.stdout
    got = step_losses(out)
    assert sorted(got) == list(range(1, 21))
    for s in plain:
        assert got[s] == pytest.approx(plain[s], rel=1e-5), (s, plain[s], got[s])


def test_node_bound_routing_keeps_tokens_on_one_node(tmp_path, small_data):
    """--comm.route_groups=node with 2 groups on the 2 nodes, topk_group=1: every token's 4
    experts lie on one node, so dedup sends each remote token once (flat: 4 times), and forced
    migrations every 2 steps keep every expert on its group's node."""
    import json

    out = tmp_path / "bound"
    args = [*COMMON, "--data", small_data, "--model.n_routed_experts=16", "--model.n_group=2",
            "--model.topk_group=1", "--comm.route_groups=node", "--comm.alltoall=dedup",
            "--comm.a2a_overlap=layer", "--comm.a2a_chunks=2", "--balance.enabled=true",
            "--debug.force_every=2", "--train.steps=6", f"--train.out_dir={out}"]
    r = run_train(args, nproc=4)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-5000:]
    assert "a token reaches at most 1 node(s)" in r.stdout
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    steps = [x for x in rows if "ep_remote_rows" in x]
    assert len(steps) == 6 and all(x["ep_remote_rows"] > 0 for x in steps)
    assert all(x["ep_flat_remote_rows"] == 4 * x["ep_remote_rows"] for x in steps)
    # the busiest of the 2 nodes sends between the mean and all of the inter-node rows
    assert all(1.0 <= x["ep_node_imbalance"] <= 2.0 for x in steps)
    meta = json.loads((out / "checkpoints" / "step_00000006" / "meta.json").read_text())
    El = 16 // 4
    for placement in meta["placement"].values():  # expert e's slot: node = slot // (2 El)
        assert placement != list(range(16))  # experts moved
        assert all(slot // (2 * El) == e // 8 for e, slot in enumerate(placement))
