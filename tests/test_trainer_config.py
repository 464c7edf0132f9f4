"""Run-config parsing, the mesh's rank arithmetic and the data pipeline (pure, no processes)."""

from __future__ import annotations

import numpy as np
import pytest

from trainer.config import ConfigError, parse_args
from trainer.data import DataError, load_corpus
from trainer.distributed.mesh import Mesh, MeshError


def test_cli_overrides_and_types(tmp_path):
    f = tmp_path / "run.toml"
    f.write_text('[train]\nsteps = 7\n[model]\npreset = "tiny"\nd_model = 64\n')
    cfg = parse_args(["--config", str(f), "--train.steps=9", "--optim.lr=1e-3",
                      "--model.n_layers=3", "--balance.enabled=true", "--resume"])
    assert cfg.train.steps == 9 and isinstance(cfg.train.steps, int)
    assert cfg.optim.lr == pytest.approx(1e-3)
    assert cfg.model.overrides == {"d_model": 64, "n_layers": 3}
    assert cfg.balance.enabled is True
    assert cfg.train.resume == "latest"


@pytest.mark.parametrize("argv, needle", [
    (["--train.stepz=3"], "unknown option train.stepz; valid: steps"),
    (["--trian.steps=3"], "unknown config section 'trian'"),
    (["--train.steps=abc"], "expected an integer"),
    (["--balance.enabled=maybe"], "expected a boolean"),
    (["stray"], "unexpected argument 'stray'"),
    (["--config", "/nonexistent/x.toml"], "does not exist"),
])
def test_bad_cli(argv, needle):
    with pytest.raises(ConfigError, match=None) as e:
        parse_args(argv)
    assert needle in str(e.value)


def test_debug_knobs_have_their_own_section():
    cfg = parse_args(["--debug.fault_rank=1", "--debug.skew=2.5", "--debug.force_every=3"])
    assert (cfg.debug.fault_rank, cfg.debug.skew, cfg.debug.force_every) == (1, 2.5, 3)
    for old in ("--train.fault_rank=1", "--balance.skew=1", "--balance.force_every=2",
                "--train.logging_ab=true", "--data.trace=true"):
        with pytest.raises(ConfigError, match="unknown option"):
            parse_args([old])


def test_help_documents_every_field(capsys):
    """`train.py --help`: every field of every section, under its section's heading, with the
    default, the meaning and the valid values from the field's `opt` docs."""
    import dataclasses

    from trainer.config import RunConfig

    with pytest.raises(SystemExit) as e:
        parse_args(["--help"])
    assert e.value.code == 0
    lines = capsys.readouterr().out.splitlines()
    cfg = RunConfig()
    for section in dataclasses.fields(cfg):
        heading = next(i for i, ln in enumerate(lines) if ln.startswith(f"[{section.name}]"))
        body = lines[heading + 1:]
        body = body[:body.index("")] if "" in body else body
        for f in dataclasses.fields(getattr(cfg, section.name)):
            help_, valid = f.metadata["help"], f.metadata["valid"]
            assert help_ and valid, f"{section.name}.{f.name} has no help / valid values"
            flag = "--model.<field>=" if f.name == "overrides" else f"--{section.name}.{f.name}="
            line = next((ln for ln in body if ln.strip().startswith(flag)), None)
            assert line is not None, f"--help does not list {flag} under [{section.name}]"
            assert help_ in line and f"valid: {valid}" in line


def test_bad_toml(tmp_path):
    f = tmp_path / "bad.toml"
    f.write_text("[train\nsteps=")
    with pytest.raises(ConfigError, match="not valid TOML"):
        parse_args(["--config", str(f)])


def test_mesh_layout_ep_innermost():
    # 8 ranks, pp=2 x dp=2 x ep=2: EP groups are consecutive pairs
    m = Mesh.plan(8, 5, pp=2, ep=2)
    assert (m.pp_idx, m.dp_idx, m.ep_idx) == (1, 0, 1)
    assert m.ep_ranks() == [4, 5]
    assert m.dp_ranks() == [5, 7]
    assert m.stage_ranks() == [4, 5, 6, 7]
    assert m.pp_ranks() == [1, 5]
    # every rank has exactly one coordinate triple
    coords = {(Mesh.plan(8, r, 2, 2).pp_idx, Mesh.plan(8, r, 2, 2).dp_idx, Mesh.plan(8, r, 2, 2).ep_idx)
              for r in range(8)}
    assert len(coords) == 8


def test_mesh_layout_ep_spread():
    # 8 ranks, pp=2 x dp=2 x ep=2, EP outermost: rank = (ep * pp + pp_idx) * dp + dp_idx
    m = Mesh.plan(8, 5, pp=2, ep=2, placement="spread")
    assert (m.pp_idx, m.dp_idx, m.ep_idx) == (0, 1, 1)
    assert m.ep_ranks() == [1, 5]  # 4 ranks apart: one from each half of the world
    assert m.dp_ranks() == [4, 5]
    assert m.stage_ranks() == [0, 4, 1, 5]
    assert m.pp_ranks() == [5, 7]
    for r in range(8):
        assert m.rank_of(*m.coords(r)) == r
    assert len({m.coords(r) for r in range(8)}) == 8
    with pytest.raises(MeshError, match=r"ep_placement='nearby'; valid: local, spread"):
        Mesh.plan(8, 0, pp=2, ep=2, placement="nearby")


def test_mesh_errors():
    with pytest.raises(MeshError, match=r"world size 4 does not match the mesh pp=1 x dp=3 x ep=2 = 6"):
        Mesh.plan(4, 0, pp=1, ep=2, dp=3)
    with pytest.raises(MeshError, match=r"not divisible by pp=1 x ep=3"):
        Mesh.plan(4, 0, pp=1, ep=3)


def test_data_shards_union_is_global_batch(tmp_path):
    f = tmp_path / "t.txt"
    f.write_bytes(bytes(range(256)) * 40)
    c = load_corpus(str(f), 0.1)
    full_x, full_y = c.batch(3, 8, 16, 0, 1, seed=1)
    parts = [c.batch(3, 8, 16, i, 4, seed=1) for i in range(4)]
    assert np.array_equal(np.concatenate([p[0] for p in parts]), full_x.numpy())
    assert np.array_equal(full_x[:, 1:].numpy(), full_y[:, :-1].numpy())  # targets shift by one
    # validation draws never overlap training tokens: the split is a fixed tail
    assert len(c.train) + len(c.val) == 256 * 40


def test_data_bin_and_folder(tmp_path):
    b = tmp_path / "tok.bin"
    np.arange(1000, dtype=np.uint16).tofile(b)
    c = load_corpus(str(b), 0.1)
    assert c.max_token == 999 and c.train.dtype == np.uint16
    with pytest.raises(DataError, match="token id 999 does not fit the model's vocab_size 256"):
        c.check(16, 256)
    d = tmp_path / "folder"
    d.mkdir()
    (d / "a.txt").write_text("hello " * 100)
    (d / "b.txt").write_text("world " * 100)
    c2 = load_corpus(str(d), 0.1)
    assert "2 files" in c2.source
    with pytest.raises(DataError, match="does not exist"):
        load_corpus(str(tmp_path / "missing"), 0.1)
    odd = tmp_path / "odd.bin"
    odd.write_bytes(b"\x00" * 7)
    with pytest.raises(DataError, match="not a whole number of uint16 tokens"):
        load_corpus(str(odd), 0.1)


def test_default_corpus_is_deterministic():
    from trainer.data import default_corpus_files

    files = default_corpus_files()
    assert files == sorted(files) and len(files) > 100
    assert all(f.suffix == ".py" and "site-packages" not in f.parts for f in files)
