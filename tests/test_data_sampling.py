"""Epochs without replacement, blends and `python -m trainer.data order` (trainer/data/sampling.py).

References: the windows' own tokens (every token file here holds 0, 1, 2, ... so a window's
first token names its offset, and sources hold disjoint id ranges so a token names its file),
the set of all windows, and the target shares; the trainer's consumption is read from its
--debug.trace_data rows and compared with the CLI's."""

from __future__ import annotations

import json
from fractions import Fraction

import numpy as np
import pytest
import torch
from conftest import run_train
from hypothesis import given
from hypothesis import strategies as st

from trainer.data import DataError, load_data
from trainer.data.prepare import main
from trainer.data.sampling import WindowOrder, parse_blend, permute

S = 8  # sequence length of the small cases


def _bin(path, first: int, n: int) -> str:
    """A legacy .bin (uint16, no sidecar) holding first, first + 1, ..., first + n - 1."""
    np.arange(first, first + n, dtype=np.uint16).tofile(path)
    return str(path)


@given(n=st.integers(1, 3000), seed=st.integers(0, 2**31), epoch=st.integers(0, 50))
def test_permute_is_a_bijection(n, seed, epoch):
    p = permute(np.arange(n), n, (seed, 0, epoch))
    assert np.array_equal(np.sort(p), np.arange(n))


def test_epochs_are_shuffled_differently():
    a, b = (permute(np.arange(1000), 1000, (7, 0, e)) for e in (0, 1))
    assert not np.array_equal(a, b) and not np.array_equal(a, np.arange(1000))


def _read_windows(data, steps, B, dp, seed, first=0):
    """Window indices (start // S) the batches of steps first..first+steps-1 hold, in global
    row order, read from the tokens themselves (token value = offset in the file)."""
    rows = []
    for step in range(first, first + steps):
        for shard in range(dp):
            x, y = data.batch(step, B, S, shard, dp, seed)
            assert np.array_equal(x[:, 1:].numpy(), y[:, :-1].numpy())
            assert np.array_equal(x[:, 0:1].numpy() + np.arange(S), x.numpy())
            rows += (x[:, 0] // S).tolist()
    return rows


@pytest.mark.parametrize("dp", [1, 2])
def test_epoch_covers_every_window_once_resumed_mid_epoch(tmp_path, dp):
    # 37 windows, a global batch of 4: epochs end inside a batch (37 = 9 x 4 + 1)
    data = load_data(_bin(tmp_path / "a.bin", 0, 37 * S + 1 + 40), 0.1)
    n = data.n_windows(S)
    assert n == 37 == (len(data.train) - 1) // S
    B, steps = 4, 2 * 37 // 4 + 1  # two whole epochs and a bit
    whole = _read_windows(data, steps, B, dp, seed=5)
    for e in range(2):
        assert sorted(whole[e * n:(e + 1) * n]) == list(range(n)), e
    assert whole[:n] != whole[n:2 * n]  # each epoch its own order
    # a fresh process resuming at step 5 (mid epoch) reads exactly what the whole run read
    again = load_data(str(tmp_path / "a.bin"), 0.1)
    assert _read_windows(again, steps - 5, B, dp, seed=5, first=5) == whole[5 * B:]
    # and the layout does not matter: DP 1 and DP 2 read the same global rows
    assert _read_windows(data, steps, B, 3 - dp, seed=5) == whole


def test_random_sampling_keeps_the_old_draws(tmp_path):
    data = load_data(_bin(tmp_path / "a.bin", 0, 2000), 0.1, sampling="random")
    x, _ = data.batch(3, 8, S, 0, 1, seed=1)
    g = np.random.default_rng([1, 3, 0])  # the draw of the sampler before epochs
    offs = g.integers(0, len(data.train) - S - 1, size=8, endpoint=True)
    assert x[:, 0].tolist() == offs.tolist()


def test_blend_shares_within_one_point_each_source_in_epochs(tmp_path):
    sizes = {"a": 2400, "b": 800, "c": 430}  # tokens: 284, 94 and 51 windows of training data
    files = {k: _bin(tmp_path / f"{k}.bin", 10_000 * i, n) for i, (k, n) in enumerate(sizes.items())}
    spec = f"{files['a']}:0.5,{files['b']}:0.3,{files['c']}:0.2"
    data = load_data("", 0.05, blend=spec)
    lens = [p.n_windows(S) for p in data.parts]
    assert lens == [(n - int(n * 0.05) - 1) // S for n in sizes.values()] == [284, 94, 51]
    B, steps = 20, 500  # 10,000 windows
    seen: dict[int, list[int]] = {0: [], 1: [], 2: []}
    for step in range(steps):
        for shard in range(2):
            x, _ = data.batch(step, B, S, shard, 2, seed=3)
            for t0 in x[:, 0].tolist():
                seen[t0 // 10_000].append((t0 % 10_000) // S)
    total = sum(map(len, seen.values()))
    assert total == B * steps
    for d, w in enumerate((0.5, 0.3, 0.2)):
        assert abs(len(seen[d]) / total - w) < 0.01, (d, len(seen[d]))
        n = lens[d]
        for e in range(len(seen[d]) // n):  # every whole epoch of the source: each window once
            assert sorted(seen[d][e * n:(e + 1) * n]) == list(range(n)), (d, e)
    # resuming at step 123 needs no history
    x, _ = load_data("", 0.05, blend=spec).batch(123, B, S, 1, 2, seed=3)
    assert x.tolist() == data.batch(123, B, S, 1, 2, seed=3)[0].tolist()


@given(w=st.lists(st.integers(1, 50), min_size=1, max_size=5), g0=st.integers(0, 5000))
def test_blend_order_is_a_pure_function_of_the_index(w, g0):
    weights = [Fraction(x, sum(w)) for x in w]
    o = WindowOrder([7] * len(w), weights, S, 0)
    src, cnt = o.sources(0, g0 + 40)
    s2, c2 = o.sources(g0, 40)
    assert np.array_equal(s2, src[g0:]) and np.array_equal(c2, cnt[g0:])
    for d in range(len(w)):  # per-source counts run 0, 1, 2, ... and stay within 1 of quota
        assert np.array_equal(cnt[src == d], np.arange((src == d).sum()))
        assert abs((src == d).sum() - float(weights[d]) * len(src)) <= len(w) / 2 + 1


def test_order_cli_prints_what_the_batches_hold(tmp_path, capsys):
    a, b = _bin(tmp_path / "a.bin", 0, 400), _bin(tmp_path / "b.bin", 20_000, 300)
    for spec, files in ((a, None), (f"{a}:0.6,{b}:0.4", [a, b])):
        assert main(["order", "--data", spec, "--seq", str(S), "--global-batch", "6", "--dp",
                     "2", "--steps", "3", "--seed", "9"]) == 0
        rows = [json.loads(x) for x in capsys.readouterr().out.splitlines()]
        data = load_data("", 0.005, blend=spec) if files else load_data(spec, 0.005)
        want = {p.source: p.n_windows(S) for p in (data.parts if files else [data])}
        assert rows[0] == {"windows_per_epoch": want if files else want[a]}
        assert [(r["step"], r["rank"]) for r in rows[1:]] == [(s, r) for s in (1, 2, 3)
                                                              for r in (0, 1)]
        for r in rows[1:]:
            x, _ = data.batch(r["step"] - 1, 6, S, r["rank"], 2, seed=9)
            first = x[:, 0].numpy()
            names = r["files"] if files else [r["file"]] * len(r["starts"])
            assert [20_000 if f == b else 0 for f in names] == (first // 20_000 * 20_000).tolist()
            assert r["starts"] == (first % 20_000).tolist()


BAD = {
    "weight zero": (dict(blend="{a}:0,{b}:1"), ["weight 0 must be > 0"]),
    "weight negative": (dict(blend="{a}:-0.2,{b}:1.2"), ["weight -0.2 must be > 0"]),
    "not summing to 1": (dict(blend="{a}:0.7,{b}:0.7"), ["sum to 1.4, not 1"]),
    "not a number": (dict(blend="{a}:half,{b}:0.5"), ["weight 'half' is not a number"]),
    "no weight": (dict(blend="{a},{b}:0.5"), ["is not FILE:WEIGHT"]),
    "missing file": (dict(blend="{a}:0.5,/no/such.bin:0.5"),
                     ["source '/no/such.bin' does not exist"]),
    "twice": (dict(blend="{a}:0.5,{a}:0.5"), ["names", "twice"]),
    "path and blend": (dict(path="{a}", blend="{a}:0.5,{b}:0.5"), ["both given"]),
    "unknown sampling": (dict(path="{a}", sampling="shuffle"),
                         ["--data.sampling='shuffle'", "valid: epoch, random"]),
    "random blend": (dict(blend="{a}:0.5,{b}:0.5", sampling="random"),
                     ["--data.sampling=random reads one file"]),
    "mask missing": (dict(path="{a}", loss_mask=True), ["--data.loss_mask=true needs a loss mask"]),
}


@pytest.mark.parametrize("name", sorted(BAD))
def test_bad_data_options(name, tmp_path):
    a, b = _bin(tmp_path / "a.bin", 0, 400), _bin(tmp_path / "b.bin", 0, 400)
    kw, needles = BAD[name]
    kw = {k: v.format(a=a, b=b) if isinstance(v, str) else v for k, v in kw.items()}
    kw.setdefault("path", "")
    with pytest.raises(DataError) as e:
        load_data(kw.pop("path"), 0.05, **kw)
    for n in needles:
        assert n in str(e.value), str(e.value)


def test_parse_blend_normalises_exactly():
    spec = parse_blend("a:1/3,b:1/3,c:1/3")
    assert [w for _, w in spec] == [Fraction(1, 3)] * 3
    assert sum(w for _, w in parse_blend("a:0.333333,b:0.333333,c:0.333334")) == 1


def _trace(out) -> list[dict]:
    rows = []
    for f in sorted(out.glob("data_order.rank*.jsonl")):
        rows += [json.loads(x) for x in f.read_text().splitlines()]
    return sorted(rows, key=lambda r: (r["step"], r["rank"]))


SMALL = ["--model.d_model=32", "--model.moe_ffn_dim=32", "--model.n_heads=2",
         "--model.n_kv_heads=1", "--model.head_dim=16", "--model.n_layers=2",
         "--train.seq_len=16", "--train.global_batch=4", "--train.eval_every=0",
         "--train.eval_batches=1", "--train.plot=false", "--train.peak_tflops=1",
         "--debug.trace_data=true", "--data.seed=11", "--data.val_fraction=0.02"]


def _cli_rows(capsys, spec, dp, steps) -> list[dict]:
    assert main(["order", "--data", spec, "--seq", "16", "--global-batch", "4", "--dp",
                 str(dp), "--steps", str(steps), "--seed", "11", "--val-fraction", "0.02"]) == 0
    return [json.loads(x) for x in capsys.readouterr().out.splitlines()][1:]


@pytest.mark.integration
def test_trainer_reads_the_cli_order_and_resumes_it(tmp_path, capsys):
    a, b = _bin(tmp_path / "a.bin", 0, 3000), _bin(tmp_path / "b.bin", 3000, 2000)
    spec = f"{a}:0.7,{b}:0.3"
    whole, split = tmp_path / "whole", tmp_path / "split"
    r = run_train([*SMALL, f"--data.blend={spec}", "--train.steps=4",
                   "--model.vocab_size=5000", f"--train.out_dir={whole}"])
    assert r.returncode == 0, r.stderr[-3000:]
    for extra in (["--train.stop_after=2"], ["--resume"]):
        r = run_train([*SMALL, f"--data.blend={spec}", "--train.steps=4",
                       "--model.vocab_size=5000", f"--train.out_dir={split}", *extra])
        assert r.returncode == 0, r.stderr[-3000:]
    want = _cli_rows(capsys, spec, 1, 4)
    assert _trace(whole) == want
    assert _trace(split) == want
    rows = [json.loads(x) for x in (whole / "metrics.jsonl").read_text().splitlines()]
    assert [m["tokens_seen"] for m in rows if "loss" in m] == [64, 128, 192, 256]


@pytest.mark.integration
@pytest.mark.multiproc
@pytest.mark.slow
def test_trainer_dp2_reads_the_cli_order(tmp_path, capsys):
    a = _bin(tmp_path / "a.bin", 0, 3000)
    out = tmp_path / "dp2"
    r = run_train([*SMALL, f"--data={a}", "--train.steps=3", "--model.vocab_size=3000",
                   "--parallel.dp=2", "--comm.alltoall=flat", f"--train.out_dir={out}"], nproc=2)
    assert r.returncode == 0, r.stderr[-3000:]
    assert _trace(out) == _cli_rows(capsys, a, 2, 3)


def test_blend_validation_batches_do_not_depend_on_the_layout(tmp_path):
    a, b = _bin(tmp_path / "a.bin", 0, 3000), _bin(tmp_path / "b.bin", 10_000, 3000)
    data = load_data("", 0.1, blend=f"{a}:0.5,{b}:0.5")
    one = data.batch(4, 8, S, 0, 1, seed=2, split="val")[0]
    four = torch.cat([data.batch(4, 8, S, i, 4, seed=2, split="val")[0] for i in range(4)])
    assert torch.equal(one, four)
    for row in one.tolist():  # windows of the validation splits (the files' last 10 %)
        first = row[0] % 10_000
        assert first >= 2700 and first + S < 3000
