"""Every bad request stops with one clear message before any training step.

Most cases call the trainer's validation (`parse_args` + `prepare`) in-process, which is exactly
what train.py runs before it starts any process group or step; two cases go through train.py
(one process and torchrun) to check the exit status, stderr and that nothing was trained.
"""

from __future__ import annotations

import json

import pytest
from conftest import run_train

from trainer import parse_args, prepare


@pytest.fixture(scope="module")
def text_file(tmp_path_factory):
    p = tmp_path_factory.mktemp("d") / "t.txt"
    p.write_bytes(b"def f(x):\n    return x + 1\n" * 2000)
    return str(p)


def _ck(tmp_path, meta: str | None, metadata: bytes | None, shard: bytes | None = None):
    ck = tmp_path / "ck" / "step_00000005"
    ck.mkdir(parents=True)
    if meta is not None:
        (ck / "meta.json").write_text(meta)
    if metadata is not None:
        (ck / ".metadata").write_bytes(metadata)
    if shard is not None:
        (ck / "__0_0.distcp").write_bytes(shard)
    return ck


CASES = {
    "unknown preset": (["--model.preset=mixtral-9x9b"], 1, ["mixtral-9x9b", "tiny", "deepseek-v3"]),
    "ep does not divide experts": (["--parallel.ep=3", "--train.global_batch=3"], 3,
                                   ["ep=3 does not divide 8 experts", "valid ep: [1, 2, 4, 8]"]),
    "world size vs mesh": (["--parallel.ep=2", "--parallel.dp=2"], 1,
                           ["world size 1 does not match the mesh pp=1 x dp=2 x ep=2 = 4"]),
    "world not divisible": (["--parallel.ep=4"], 6, ["world size 6 is not divisible by pp=1 x ep=4"]),
    "missing data": (["--data=/no/such/file.txt"], 1, ["data path '/no/such/file.txt' does not exist"]),
    "sequence too long": (["--train.seq_len=100000"], 1,
                          ["train.seq_len=100000 is outside what the model supports: 1..256"]),
    "unknown model field": (["--model.d_modle=64"], 1, ["unknown model field(s) ['d_modle']"]),
    "bad model value": (["--model.top_k=9"], 1, ["top_k"]),
    "batch vs shards": (["--parallel.ep=2", "--train.global_batch=3"], 2,
                        ["train.global_batch=3 must be a positive multiple of the 2 data shards"]),
    "bad alltoall": (["--comm.alltoall=fast"], 1,
                     ["comm.alltoall='fast'; valid: flat, halo, dedup, auto"]),
    "bad a2a overlap": (["--comm.a2a_overlap=fbb"], 1,
                        ["comm.a2a_overlap='fbb'; valid: none, layer, fb, auto"]),
    "fb needs micro-batches": (["--comm.a2a_overlap=fb"], 1,
                               ["comm.a2a_overlap=fb with parallel.microbatches=1", ">= 2"]),
    "bad a2a chunks": (["--comm.a2a_chunks=0"], 1,
                       ["comm.a2a_chunks='0'; valid: an integer >= 1, or auto"]),
    "a2a chunks not a number": (["--comm.a2a_chunks=many"], 1,
                                ["comm.a2a_chunks='many'; valid: an integer >= 1, or auto"]),
    "microbatches vs batch": (["--parallel.pp=2", "--parallel.microbatches=3"], 2,
                              ["parallel.microbatches=3 must divide the 16 sequences"]),
    "more stages than layers": (["--parallel.pp=2", "--parallel.n_virtual=4", "--parallel.microbatches=4",
                                 "--parallel.schedule=interleaved-1f1b"], 2,
                                ["8 pipeline stages (pp x n_virtual) exceed the model's 4 layers"]),
    "virtual stages need interleaving": (["--parallel.pp=2", "--parallel.n_virtual=2"], 2,
                                         ["parallel.n_virtual=2: values > 1 need"]),
    "bad layer split": (["--parallel.pp=2", "--parallel.layer_split=1,2"], 2,
                        ["parallel.layer_split='1,2': need 2 positive counts", "n_layers=4"]),
    "unknown schedule": (["--parallel.pp=2", "--parallel.schedule=1f2b"], 2,
                         ["unknown schedule '1f2b'", "gpipe"]),
    "bad nan policy": (["--train.nan_policy=ignore"], 1, ["train.nan_policy='ignore'; valid: skip, stop"]),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_bad_request(name, text_file):
    argv, world, needles = CASES[name]
    with pytest.raises(ValueError) as e:
        cfg = parse_args(["--config", "configs/tiny-ep-dp.toml", "--parallel.ep=1", f"--data={text_file}",
                          *argv])
        prepare(cfg, world, 0)
    for n in needles:
        assert n in str(e.value), str(e.value)


@pytest.mark.parametrize("kind", ["incomplete", "corrupt meta", "another model", "no checkpoint"])
def test_bad_checkpoint(kind, tmp_path, text_file):
    if kind == "incomplete":
        ck, needle = _ck(tmp_path, None, None, b"garbage"), "is incomplete"
    elif kind == "corrupt meta":
        ck, needle = _ck(tmp_path, "{not json", b"\x00\x01"), "corrupt meta.json"
    elif kind == "another model":
        ck = _ck(tmp_path, json.dumps({"step": 5, "model": {"d_model": 4096}}), b"\x00")
        needle = "belongs to another model: fields differ: d_model (checkpoint 4096, run 128)"
    else:
        ck, needle = "latest", "no complete checkpoint under"
    cfg = parse_args(["--config", "configs/tiny-ep-dp.toml", "--parallel.ep=1", f"--data={text_file}",
                      f"--train.out_dir={tmp_path / 'out'}", f"--resume={ck}"])
    with pytest.raises(ValueError) as e:
        prepare(cfg, 1, 0)
    assert needle in str(e.value), str(e.value)


@pytest.mark.integration
def test_train_py_reports_and_exits(tmp_path, text_file):
    """End to end: train.py prints one `error:` line on rank 0 and exits 2, nothing trained."""
    out = tmp_path / "run"
    r = run_train(["--config", "configs/tiny-ep-dp.toml", f"--train.out_dir={out}", f"--data={text_file}",
                   "--parallel.ep=3"], nproc=2, timeout=300,
                  launcher="torchrun")  # torchrun's agent stops the others when one rank exits
    assert r.returncode != 0
    assert r.stderr.count("error: world size 2 is not divisible by pp=1 x ep=3 = 3") == 1, r.stderr
    assert not out.exists()
    r = run_train(["--config", "configs/tiny-ep-dp.toml", f"--train.out_dir={out}", "--model.preset=nope"])
    assert r.returncode == 2 and "error: unknown model preset 'nope'; valid: " in r.stderr, r.stderr
    assert not out.exists()
