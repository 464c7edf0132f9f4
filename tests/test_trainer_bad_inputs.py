"""Every bad request stops with one clear message before any training step (exit code 2)."""

from __future__ import annotations

import json

import pytest

from conftest import run_train


def _fails(tmp_path, args, needle, nproc=1):
    out = tmp_path / "run"
    r = run_train(["--config", "configs/tiny.toml", f"--train.out_dir={out}", "--train.steps=2",
                   "--parallel.ep=1", *args], nproc=nproc, timeout=300)
    assert r.returncode != 0, r.stdout + r.stderr
    assert needle in r.stderr, r.stderr
    assert not (out / "metrics.jsonl").exists()  # no training step ran
    return r


def test_unknown_preset(tmp_path):
    r = _fails(tmp_path, ["--model.preset=mixtral-9x9b"], "mixtral-9x9b")
    assert "tiny" in r.stderr and "deepseek-v3" in r.stderr  # lists the valid names


def test_ep_not_dividing_experts(tmp_path):
    _fails(tmp_path, ["--parallel.ep=3", "--parallel.dp=0"], "not divisible by pp=1 x ep=3")


def test_ep_not_dividing_experts_world_ok(tmp_path):
    # world 1 with --model.n_routed_experts=6 and ep=4 ... world must match first; use world-free
    # check: 8 experts, ep=3 under 3 processes
    _fails(tmp_path, ["--parallel.ep=3", "--train.global_batch=3"], "ep=3 does not divide 8 experts",
           nproc=3)


def test_world_size_mismatch(tmp_path):
    _fails(tmp_path, ["--parallel.ep=2", "--parallel.dp=2"],
           "world size 1 does not match the mesh pp=1 x dp=2 x ep=2 = 4")


def test_missing_data(tmp_path):
    _fails(tmp_path, ["--data", str(tmp_path / "nope.txt")], "does not exist")


def test_seq_too_long(tmp_path):
    _fails(tmp_path, ["--train.seq_len=100000"], "train.seq_len=100000 is outside what the model supports")


def test_unknown_model_field(tmp_path):
    _fails(tmp_path, ["--model.d_modle=64"], "unknown model field(s) ['d_modle']")


def test_incomplete_checkpoint(tmp_path):
    ck = tmp_path / "ck" / "step_00000005"
    ck.mkdir(parents=True)
    (ck / "__0_0.distcp").write_bytes(b"garbage")
    _fails(tmp_path, [f"--resume={ck}"], "is incomplete")


def test_corrupt_checkpoint_meta(tmp_path):
    ck = tmp_path / "ck" / "step_00000005"
    ck.mkdir(parents=True)
    (ck / ".metadata").write_bytes(b"\x00\x01")
    (ck / "meta.json").write_text("{not json")
    _fails(tmp_path, [f"--resume={ck}"], "corrupt meta.json")


def test_checkpoint_of_another_model(tmp_path):
    ck = tmp_path / "ck" / "step_00000005"
    ck.mkdir(parents=True)
    (ck / ".metadata").write_bytes(b"\x00")
    (ck / "meta.json").write_text(json.dumps({"step": 5, "model": {"d_model": 4096}}))
    _fails(tmp_path, [f"--resume={ck}"], "belongs to another model")


@pytest.mark.parametrize("arg, needle", [
    ("--train.global_batch=3", "must be a positive multiple of the 1 data shards") ,
    ("--comm.alltoall=fast", "comm.alltoall='fast'; valid: flat, halo, auto"),
])
def test_other_bad_values(tmp_path, arg, needle):
    if "global_batch=3" in arg:
        _fails(tmp_path, ["--train.global_batch=0"], "train.global_batch=0 must be a positive multiple")
    else:
        _fails(tmp_path, [arg], needle)
