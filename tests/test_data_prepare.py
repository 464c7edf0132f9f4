"""`python -m trainer.data prepare`: text and JSONL -> token-id .bin + sidecar, read back by
load_corpus. Reference: the `tokenizers` library called directly, one document at a time."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest
import torch
from conftest import ROOT
from tokenizers import Tokenizer, models, pre_tokenizers, trainers

from trainer.data import DataError, load_corpus, sidecar_path
from trainer.data.prepare import main, prepare

DOCS = [
    "the quick brown fox jumps over the lazy dog",
    "a stitch in time saves nine\nand a penny saved is a penny earned",
    "",  # an empty document still gets its EOS
    "pack my box with five dozen liquor jugs. ünïcödé wörds too",
    "the end",
]
RECORDS = [{"text": "json records are documents too", "id": 1},
           {"text": "the second record, with the lazy dog", "id": 2},
           {"text": "third", "id": 3}]


@pytest.fixture(scope="module")
def bpe_dir(tmp_path_factory):
    """A BPE tokenizer trained here on DOCS, EOS "</s>" named in tokenizer_config.json."""
    d = tmp_path_factory.mktemp("bpe")
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.train_from_iterator(DOCS + [r["text"] for r in RECORDS],
                            trainers.BpeTrainer(vocab_size=300, special_tokens=["<unk>", "</s>"]))
    tok.save(str(d / "tokenizer.json"))
    (d / "tokenizer_config.json").write_text(json.dumps({"eos_token": "</s>"}))
    return d


@pytest.fixture(scope="module")
def big_tok(tmp_path_factory):
    """A word-level tokenizer with 70,000 words (ids beyond uint16), no tokenizer_config.json."""
    d = tmp_path_factory.mktemp("big")
    vocab = {"<unk>": 0, **{f"w{i}": i for i in range(1, 70_000)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.add_special_tokens(["<eod>"])  # id 70000
    tok.save(str(d / "tokenizer.json"))
    return d / "tokenizer.json"


@pytest.fixture
def text_dir(tmp_path):
    d = tmp_path / "docs"
    (d / "sub").mkdir(parents=True)
    for i, doc in enumerate(DOCS):  # sorted paths follow DOCS: 00..03.txt, then sub/04.txt
        (d / ("sub" if i == 4 else "") / f"{i:02d}.txt").write_text(doc)
    (d / ".hidden").write_text("never read")
    (d / "sub" / "cache.pyc").write_bytes(b"\xa7\r\r\n\x00\x00 binary")  # skipped: NUL bytes
    return d


def _reference(tok_json, docs: list[str], eos: str) -> np.ndarray:
    tok = Tokenizer.from_file(str(tok_json))
    eos_id = tok.token_to_id(eos)
    return np.array([t for doc in docs for t in [*tok.encode(doc).ids, eos_id]], dtype=np.int64)


def _jsonl(path, records) -> None:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))


def test_text_folder_and_jsonl_match_the_tokenizer(bpe_dir, text_dir, tmp_path):
    jl = tmp_path / "recs.jsonl"
    _jsonl(jl, RECORDS)
    out = tmp_path / "out" / "train.bin"
    meta = prepare(bpe_dir, [str(text_dir), str(jl)], out, workers=1, progress=False)
    ref = _reference(bpe_dir / "tokenizer.json", DOCS + [r["text"] for r in RECORDS], "</s>")
    got = np.fromfile(out, dtype=np.uint16)
    np.testing.assert_array_equal(got.astype(np.int64), ref)
    side = json.loads(sidecar_path(out).read_text())
    tok = Tokenizer.from_file(str(bpe_dir / "tokenizer.json"))
    assert side["dtype"] == "uint16" and side["eos_id"] == tok.token_to_id("</s>")
    assert side["vocab_size"] == tok.get_vocab_size() <= 300
    assert side["n_documents"] == len(DOCS) + len(RECORDS) and side["n_tokens"] == len(ref)
    assert side["field"] == "text" and side["n_files"] == len(DOCS) + 1
    assert side["skipped_binary"] == [str(text_dir / "sub" / "cache.pyc")]
    assert side["n_skipped_binary"] == 1
    import hashlib

    assert side["tokenizer"]["sha256"] == hashlib.sha256(
        (bpe_dir / "tokenizer.json").read_bytes()).hexdigest()
    assert {k: meta[k] for k in side} == side
    c = load_corpus(str(out), 0.2)
    assert c.train.dtype == np.uint16 and c.max_token == ref.max()
    assert (c.vocab_size, c.eos_id) == (side["vocab_size"], side["eos_id"])
    np.testing.assert_array_equal(np.concatenate([c.train, c.val]).astype(np.int64), ref)
    c.check(4, 300)


def test_workers_give_identical_files(bpe_dir, text_dir, tmp_path):
    jl = tmp_path / "many.jsonl"
    _jsonl(jl, [{"text": f"{DOCS[i % 5]} record {i}"} for i in range(200)])
    outs = []
    for w in (1, 2):
        out = tmp_path / f"w{w}.bin"
        # 256-byte batches: ~40 tasks, so both workers get many and results arrive interleaved
        prepare(bpe_dir, [str(jl), str(text_dir)], out, workers=w, progress=False,
                batch_bytes=256)
        outs.append(out)
    assert outs[0].read_bytes() == outs[1].read_bytes()
    s1, s2 = (json.loads(sidecar_path(o).read_text()) for o in outs)
    assert s1 == s2 and s1["n_documents"] == 200 + len(DOCS)


def test_vocab_over_65536_is_uint32(big_tok, tmp_path):
    docs = ["w1 w65535 w65536 w69999", "w3 unknownword w70000"]  # w70000 is not a word: <unk>
    for i, d in enumerate(docs):
        (tmp_path / f"{i}.txt").write_text(d)
    out = tmp_path / "big.bin"
    prepare(big_tok, [str(tmp_path / "0.txt"), str(tmp_path / "1.txt")], out, eos="<eod>",
            workers=2, progress=False)
    side = json.loads(sidecar_path(out).read_text())
    assert side["dtype"] == "uint32" and side["vocab_size"] == 70_001 and side["eos_id"] == 70_000
    np.testing.assert_array_equal(np.fromfile(out, dtype=np.uint32).astype(np.int64),
                                  _reference(big_tok, docs, "<eod>"))
    c = load_corpus(str(out), 0.4)  # 9 tokens: 3 for validation
    assert c.train.dtype == np.uint32 and c.max_token == 70_000
    c.check(2, 70_001)
    x, y = c.batch(0, 4, 2, 0, 1, seed=0)  # windows of uint32 ids reach the model as int64
    assert x.dtype == torch.int64 and 65_535 < int(torch.cat([x, y]).max()) <= 70_000
    assert torch.equal(x[:, 1:], y[:, :-1]) and set(x.flatten().tolist()) <= set(c.train.tolist())
    with pytest.raises(DataError) as e:  # the sidecar's vocabulary is larger than the model's
        c.check(2, 65_536)
    assert all(s in str(e.value) for s in ("70001", "vocab_size 65536", str(out)))


@pytest.mark.integration
def test_cli(bpe_dir, text_dir, tmp_path, capsys):
    out = tmp_path / "cli.bin"
    cmd = [sys.executable, "-W", "error::RuntimeWarning", "-m", "trainer.data", "prepare",
           "--tokenizer", str(bpe_dir), "--input", str(text_dir), "--workers", "2",
           "--out", str(out)]
    r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert "RuntimeWarning" not in r.stderr  # no runpy "found in sys.modules" warning
    assert f"{sum(len(_reference(bpe_dir / 'tokenizer.json', [d], '</s>')) for d in DOCS):,} tokens" \
        in r.stdout
    np.testing.assert_array_equal(np.fromfile(out, dtype=np.uint16),
                                  _reference(bpe_dir / "tokenizer.json", DOCS, "</s>"))
    # the error path in-process (a second interpreter start costs ~4 s of CPU importing torch)
    assert main(cmd[cmd.index("prepare"):]) == 1
    assert f"error: {str(out)!r} already exists; pass --overwrite" in capsys.readouterr().err


# -- bad input: a clear error, nothing written ----------------------------------------------------
def _nothing_written(out) -> None:
    out_side = sidecar_path(out)
    leftovers = [p for p in (out, out_side, out.with_name(out.name + ".part"),
                             out_side.with_name(out_side.name + ".part")) if p.exists()]
    assert not leftovers, leftovers


def test_tokenizer_path_without_tokenizer_json(text_dir, tmp_path):
    out = tmp_path / "x.bin"
    with pytest.raises(DataError, match="no tokenizer.json at .*pass --tokenizer as"):
        prepare(tmp_path, [str(text_dir)], out, progress=False)
    _nothing_written(out)


def test_missing_input(bpe_dir, tmp_path):
    out = tmp_path / "x.bin"
    with pytest.raises(DataError, match="input '.*/nope' does not exist"):
        prepare(bpe_dir, [str(tmp_path / "nope")], out, progress=False)
    (tmp_path / "empty").mkdir()
    with pytest.raises(DataError, match="input folder '.*/empty' contains no files"):
        prepare(bpe_dir, [str(tmp_path / "empty")], out, progress=False)
    (tmp_path / "blank.jsonl").write_text("\n\n")
    with pytest.raises(DataError, match="hold no documents"):
        prepare(bpe_dir, [str(tmp_path / "blank.jsonl")], out, progress=False)
    (tmp_path / "empty" / "old.bin").write_bytes(b"\x00\x01")  # e.g. an earlier output
    with pytest.raises(DataError, match="holds '.*old.bin', a .bin of token ids, not text"):
        prepare(bpe_dir, [str(tmp_path / "empty")], out, progress=False)
    _nothing_written(out)


def test_missing_eos(big_tok, text_dir, tmp_path):
    out = tmp_path / "x.bin"
    with pytest.raises(DataError, match="no EOS token: .*tokenizer_config.json.* does not exist; "
                                        "pass the end-of-document token with --eos TOKEN"):
        prepare(big_tok, [str(text_dir)], out, progress=False)
    with pytest.raises(DataError, match="EOS token '<nope>' .* is not in the vocabulary"):
        prepare(big_tok, [str(text_dir)], out, eos="<nope>", progress=False)
    _nothing_written(out)


@pytest.mark.parametrize("bad_line", [1, 3])  # line 1: checked before work; line 3: mid-run
def test_jsonl_record_without_field(bpe_dir, tmp_path, bad_line):
    jl = tmp_path / "r.jsonl"
    recs = [{"text": "fine"}] * 4
    recs[bad_line - 1] = {"body": "no text field"}
    _jsonl(jl, recs)
    out = tmp_path / "x.bin"
    with pytest.raises(DataError, match=rf"r.jsonl:{bad_line}: the record has no field 'text' "
                                        r"\(it has \['body'\]\); pick the text field with --text-field"):
        prepare(bpe_dir, [str(jl)], out, workers=2, progress=False, batch_bytes=16)
    _nothing_written(out)


def test_existing_output_is_kept(bpe_dir, text_dir, tmp_path):
    out = tmp_path / "x.bin"
    out.write_bytes(b"old!")
    with pytest.raises(DataError, match="x.bin' already exists; pass --overwrite"):
        prepare(bpe_dir, [str(text_dir)], out, progress=False)
    assert out.read_bytes() == b"old!" and not sidecar_path(out).exists()
    prepare(bpe_dir, [str(text_dir)], out, overwrite=True, progress=False)
    assert json.loads(sidecar_path(out).read_text())["n_tokens"] * 2 == out.stat().st_size


def _bin_with_sidecar(tmp_path, ids, np_dtype, **side):
    out = tmp_path / "t.bin"
    np.asarray(ids, dtype=np_dtype).tofile(out)
    meta = {"format": "piper-moe-tokens", "version": 1, "dtype": np.dtype(np_dtype).name,
            "vocab_size": 100, "eos_id": 0, "n_documents": 1, "n_tokens": len(ids), **side}
    sidecar_path(out).write_text(json.dumps(meta))
    return out


def test_bin_size_not_a_multiple_of_sidecar_dtype(tmp_path):
    out = _bin_with_sidecar(tmp_path, np.arange(50), np.uint16, dtype="uint32", n_tokens=25)
    with open(out, "ab") as f:
        f.write(b"\x00\x00")  # 102 bytes: whole uint16 tokens, not whole uint32 ones
    with pytest.raises(DataError, match=r"has 102 bytes, not a whole number of uint32 tokens "
                                        r"\(4 bytes each\) \(dtype from its sidecar"):
        load_corpus(str(out), 0.1)


def test_unknown_sidecar_dtype(tmp_path):
    out = _bin_with_sidecar(tmp_path, np.arange(50), np.uint16, dtype="int8")
    with pytest.raises(DataError, match="names dtype 'int8'; valid dtypes: uint16, uint32"):
        load_corpus(str(out), 0.1)


def test_token_id_beyond_sidecar_vocab(tmp_path):
    ids = np.arange(50)
    ids[7] = 4000
    out = _bin_with_sidecar(tmp_path, ids, np.uint16, vocab_size=1000)
    with pytest.raises(DataError, match=r"t.bin: token id 4000 does not fit the vocab_size 1000 "
                                        r"its sidecar .* names"):
        load_corpus(str(out), 0.1)


def test_sidecar_vocab_beyond_model_vocab(tmp_path):
    out = _bin_with_sidecar(tmp_path, np.arange(50) + 70_000, np.uint32, vocab_size=70_050)
    c = load_corpus(str(out), 0.1)
    with pytest.raises(DataError, match=r"t.bin: its tokenizer's vocabulary has 70050 tokens "
                                        r"\(sidecar .*t.json\), more than the model's vocab_size "
                                        r"70000"):
        c.check(4, 70_000)
    c.check(4, 70_050)


def test_token_id_beyond_model_vocab_legacy(tmp_path):
    # without a sidecar (legacy uint16) the largest id is what is checked, as before
    legacy = tmp_path / "legacy.bin"
    (np.arange(50, dtype=np.uint16) + 300).tofile(legacy)
    with pytest.raises(DataError, match=r"legacy.bin: token id 349 does not fit the model's "
                                        r"vocab_size 256; valid token ids are 0..255"):
        load_corpus(str(legacy), 0.1).check(4, 256)


def test_text_file_not_utf8(bpe_dir, text_dir, tmp_path):
    bad = text_dir / "zz_latin1.txt"  # sorts last: found mid-run, after other batches
    bad.write_bytes("caf\xe9 cr\xe8me".encode("latin-1"))
    out = tmp_path / "x.bin"
    with pytest.raises(DataError, match=r"zz_latin1.txt is not UTF-8 text"):
        prepare(bpe_dir, [str(text_dir)], out, workers=2, progress=False, batch_bytes=8)
    _nothing_written(out)
