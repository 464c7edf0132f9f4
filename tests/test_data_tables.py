"""`prepare` on columnar inputs: Parquet, Arrow (IPC file and stream) and `datasets` folders.

Reference: the same records as a JSONL file through `prepare` (the JSONL path reads each line
with json and the `tokenizers` library; tests/test_data_prepare.py checks it against the
library called directly): the outputs must be byte-identical. The `datasets` folder is written
by `datasets.Dataset.save_to_disk` itself. Skipped where pyarrow / datasets are not installed
(the `dev` extra installs both)."""

from __future__ import annotations

import json

import numpy as np
import pytest
from test_data_prepare import DOCS, RECORDS, bpe_dir  # noqa: F401 (a fixture)

from trainer.data import DataError, read_sidecar
from trainer.data.prepare import prepare

pa = pytest.importorskip("pyarrow")
pq = pytest.importorskip("pyarrow.parquet")

TEXTS = [d for d in DOCS] + [r["text"] for r in RECORDS]


def _jsonl_reference(tmp_path, bpe_dir, texts) -> bytes:  # noqa: F811
    src = tmp_path / "ref.jsonl"
    src.write_text("".join(json.dumps({"text": t, "n": i}) + "\n" for i, t in enumerate(texts)))
    prepare(bpe_dir, [str(src)], tmp_path / "ref.bin", workers=1, progress=False)
    return (tmp_path / "ref.bin").read_bytes()


@pytest.mark.parametrize("fmt", ["parquet", "arrow-file", "arrow-stream"])
@pytest.mark.parametrize("workers", [1, 2])
def test_tables_equal_the_jsonl_path(tmp_path, bpe_dir, fmt, workers):  # noqa: F811
    table = pa.table({"n": list(range(len(TEXTS))), "body": TEXTS})
    path = tmp_path / ("t.parquet" if fmt == "parquet" else "t.arrow")
    if fmt == "parquet":
        pq.write_table(table, path, row_group_size=2)  # several row groups
    else:
        with pa.OSFile(str(path), "wb") as sink:
            new = pa.ipc.new_file if fmt == "arrow-file" else pa.ipc.new_stream
            with new(sink, table.schema) as w:
                for b in table.to_batches(max_chunksize=3):
                    w.write_batch(b)
    # batch_bytes=1: one task per record batch read, so the run crosses tasks and workers
    meta = prepare(bpe_dir, [str(path)], tmp_path / "out.bin", field="body", workers=workers,
                   progress=False, batch_bytes=1)
    assert (tmp_path / "out.bin").read_bytes() == _jsonl_reference(tmp_path, bpe_dir, TEXTS)
    assert meta["n_documents"] == len(TEXTS) and meta["field"] == "body"


def test_datasets_folder_equals_the_jsonl_path(tmp_path, bpe_dir):  # noqa: F811
    datasets = pytest.importorskip("datasets")
    from datasets.table import InMemoryTable

    # an explicit fingerprint: datasets' own hashing of a fresh table fails on this pyarrow
    ds = datasets.Dataset(InMemoryTable(pa.table({"text": TEXTS})), fingerprint="t")
    ds.save_to_disk(str(tmp_path / "ds"), num_shards=3)
    assert len(list((tmp_path / "ds").glob("*.arrow"))) == 3
    prepare(bpe_dir, [str(tmp_path / "ds")], tmp_path / "out.bin", workers=1, progress=False)
    assert (tmp_path / "out.bin").read_bytes() == _jsonl_reference(tmp_path, bpe_dir, TEXTS)
    assert read_sidecar(tmp_path / "out.bin")["n_documents"] == len(TEXTS)


def test_parquet_is_streamed_with_bounded_memory(tmp_path):
    """~24 MB of text in 48 row groups: reading it holds about one record batch of Arrow
    memory at a time (pyarrow's allocator peak, what Arrow buffers cost), not the file."""
    from trainer.data.tables import iter_rows

    rng = np.random.default_rng(0)
    words = np.array(["alpha", "beta", "gamma", "delta", "epsilon", "zeta"])
    path = tmp_path / "big.parquet"
    with pq.ParquetWriter(path, pa.schema([("text", pa.string())])) as w:
        for _ in range(48):
            docs = [" ".join(rng.choice(words, 80)) for _ in range(1000)]  # ~0.5 MB per group
            w.write_table(pa.table({"text": docs}))
    pool = pa.default_memory_pool()
    base = pool.bytes_allocated()
    peak = n_rows = n_tasks = 0
    for _first, values, _nbytes in iter_rows(path, "text", 1 << 20):
        peak = max(peak, pool.bytes_allocated() - base)
        n_rows += len(values)
        n_tasks += 1
    assert n_rows == 48_000 and n_tasks > 10
    text_bytes = 48_000 * 80 * 6
    assert peak < text_bytes / 8, (peak, text_bytes)  # measured 1.1 MB (pyarrow 26)


def test_bad_text_fields(tmp_path, bpe_dir):  # noqa: F811
    path = tmp_path / "t.parquet"
    pq.write_table(pa.table({"body": ["a", None], "n": [1, 2]}), path)
    with pytest.raises(DataError, match=r"no column 'text' \(it has \['body', 'n'\]\).*--text-field"):
        prepare(bpe_dir, [str(path)], tmp_path / "o.bin", progress=False)
    with pytest.raises(DataError, match="column 'n' holds int64, not strings"):
        prepare(bpe_dir, [str(path)], tmp_path / "o.bin", field="n", progress=False)
    with pytest.raises(DataError, match="row 1: column 'body' is NoneType, not a string"):
        prepare(bpe_dir, [str(path)], tmp_path / "o.bin", field="body", workers=1,
                progress=False)
    assert not (tmp_path / "o.bin").exists() and not (tmp_path / "o.bin.part").exists()
    bad = tmp_path / "bad.arrow"
    bad.write_bytes(b"not arrow at all" * 10)
    with pytest.raises(DataError, match="is not an Arrow IPC file or stream"):
        prepare(bpe_dir, [str(bad)], tmp_path / "o.bin", progress=False)


def test_chat_records_from_parquet_equal_the_jsonl_path(tmp_path):
    from test_data_chat import CHATML, CONVS, _jsonl, _tokenizer

    from trainer.data import mask_path

    d = _tokenizer(tmp_path / "tok", CHATML)
    pq.write_table(pa.table({"messages": CONVS}), tmp_path / "c.parquet")
    prepare(d, [str(tmp_path / "c.parquet")], tmp_path / "pq.bin", progress=False, chat=True)
    prepare(d, [_jsonl(tmp_path / "c.jsonl", CONVS)], tmp_path / "js.bin", progress=False,
            chat=True)
    for f in (lambda n: tmp_path / n, lambda n: mask_path(tmp_path / n)):
        assert f("pq.bin").read_bytes() == f("js.bin").read_bytes()
    with pytest.raises(DataError, match="column 'messages' holds string, not a list"):
        pq.write_table(pa.table({"messages": ["x"]}), tmp_path / "s.parquet")
        prepare(d, [str(tmp_path / "s.parquet")], tmp_path / "o.bin", progress=False, chat=True)
