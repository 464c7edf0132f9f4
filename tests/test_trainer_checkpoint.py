"""A checkpoint killed mid-write leaves the previous one complete and loadable (single process)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest
import torch
from conftest import ROOT

CHILD = textwrap.dedent("""
    import sys, time, torch
    from pathlib import Path
    from model import MoETransformer, presets
    from trainer.checkpoint import save_checkpoint
    root, signal_file = Path(sys.argv[1]), Path(sys.argv[2])
    torch.manual_seed(0)
    cfg = presets.get("tiny").replace(d_model=32, n_layers=2, n_heads=2, n_kv_heads=1, moe_ffn_dim=32)
    model = MoETransformer(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, foreach=False)
    def step():
        tokens = torch.randint(0, 256, (2, 16))
        model.loss(tokens, tokens)[0].backward()
        opt.step(); opt.zero_grad()
    step()
    save_checkpoint(root, 1, model, opt, {"model": cfg.to_dict()})
    torch.save({k: v.clone() for k, v in model.state_dict().items()}, root / "expected.pt")
    step()
    def hang(tmp):
        # shards of step 2 are on disk; truncate one as a half-written file, then wait to be killed
        shard = sorted(p for p in tmp.iterdir() if p.suffix == ".distcp")[0]
        shard.write_bytes(shard.read_bytes()[:10])
        signal_file.write_text("writing")
        time.sleep(120)
    save_checkpoint(root, 2, model, opt, {"model": cfg.to_dict()}, _before_commit=hang)
""")


@pytest.mark.integration
def test_kill_during_save_keeps_previous(tmp_path):
    root, flag = tmp_path / "ck", tmp_path / "flag"
    env = dict(os.environ, OMP_NUM_THREADS="1")
    child = subprocess.Popen([sys.executable, "-c", CHILD, str(root), str(flag)], cwd=ROOT, env=env)
    try:
        t0 = time.time()
        while not flag.exists():
            assert child.poll() is None, "child exited before reaching the save"
            assert time.time() - t0 < 120, "child never reached the save"
            time.sleep(0.1)
        os.kill(child.pid, signal.SIGKILL)
        child.wait(timeout=30)
    finally:
        if child.poll() is None:
            child.kill()
    from model import MoETransformer, presets
    from trainer.checkpoint import CheckpointError, find_latest, load_checkpoint, read_meta

    assert (root / "step_00000002.tmp").is_dir()  # the killed save left its partial folder
    latest = find_latest(root)
    assert latest is not None and latest.name == "step_00000001"
    assert (root / "latest").read_text().strip() == "step_00000001"
    with pytest.raises(CheckpointError, match="incomplete"):
        read_meta(root / "step_00000002.tmp")
    cfg = presets.get("tiny").replace(d_model=32, n_layers=2, n_heads=2, n_kv_heads=1, moe_ffn_dim=32)
    torch.manual_seed(123)  # different init: loading must overwrite every weight
    model = MoETransformer(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, foreach=False)
    meta = load_checkpoint(latest, model, opt, cfg.to_dict())
    assert meta["step"] == 1
    expected = torch.load(root / "expected.pt")
    for k, v in model.state_dict().items():
        assert torch.equal(v, expected[k]), k
    assert all(float(opt.state[p]["step"]) == 1.0 for p in model.parameters())
