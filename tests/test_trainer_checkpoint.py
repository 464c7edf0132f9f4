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


def _tiny():
    from model import MoETransformer, presets

    cfg = presets.get("tiny").replace(d_model=32, n_layers=2, n_heads=2, n_kv_heads=1,
                                      moe_ffn_dim=32)
    return cfg, MoETransformer(cfg)


def test_migrated_placement_round_trips_in_the_unchanged_format(tmp_path):
    """A layer's slot map after a migration is saved as expert2slot [E] (meta.json, the format
    from before the slot map) and restored as the same slot map; the model computes the same.
    A placement that is not a permutation is refused by name; a state dict's expert2slot sets
    the slot map too."""
    import json

    from trainer.checkpoint import CheckpointError, load_checkpoint, save_checkpoint

    torch.manual_seed(0)
    cfg, model = _tiny()
    slots = [3, 0, 6, 1, 7, 2, 4, 5]  # slot g holds expert slots[g]
    with torch.no_grad():
        for layer in model.moe_layers():
            for w in (layer.experts.w1, layer.experts.w2, layer.experts.w3):
                w.copy_(w[torch.tensor(slots)])  # each expert's rows follow it to its slot
            layer.set_slots(slots)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    tokens = torch.randint(0, 256, (2, 16))
    model.loss(tokens, tokens)[0].backward()  # AdamW state to save
    opt.step()
    with torch.no_grad():
        want = model(tokens)
    ck = save_checkpoint(tmp_path, 1, model, opt, {"model": cfg.to_dict()})
    saved = json.loads((ck / "meta.json").read_text())["placement"]
    e2s = [slots.index(e) for e in range(8)]
    assert all(v == e2s for v in saved.values()), saved  # expert -> slot, as before

    torch.manual_seed(1)
    _, fresh = _tiny()  # identity placement, other weights
    load_checkpoint(ck, fresh, torch.optim.AdamW(fresh.parameters(), lr=1e-2), cfg.to_dict())
    for layer in fresh.moe_layers():
        assert layer.slot_map().tolist() == slots and layer.expert2slot.tolist() == e2s
    with torch.no_grad():  # the same ops on the same shapes: equal bit for bit
        assert torch.equal(fresh(tokens), want)

    meta = json.loads((ck / "meta.json").read_text())
    meta["placement"] = {k: [0, 0, 1, 2, 3, 4, 5, 6] for k in meta["placement"]}
    (ck / "meta.json").write_text(json.dumps(meta))
    with pytest.raises(CheckpointError, match="is not a permutation of 0..7"):
        load_checkpoint(ck, fresh, torch.optim.AdamW(fresh.parameters()), cfg.to_dict())

    _, other = _tiny()
    other.load_state_dict(model.state_dict())
    assert [m.slot_map().tolist() for m in other.moe_layers()] == [slots] * 2
