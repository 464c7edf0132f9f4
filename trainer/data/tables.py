"""Columnar inputs of `prepare`: Parquet files, Arrow files, and `datasets` folders.

A `.parquet` file is read row group by row group (`pyarrow.parquet.ParquetFile.iter_batches`,
only the `--text-field` column); an `.arrow` file (Arrow IPC, stream or file format, as
`datasets` caches and `save_to_disk` write them) is memory-mapped and read record batch by
record batch; a folder holding `state.json` and `dataset_info.json` is a `datasets` folder
(`Dataset.save_to_disk`): its `.arrow` shards in the order `state.json` lists them. So memory
stays at a few record batches whatever the input's size (a 10 GB input needs no 10 GB of RAM).

These need `pyarrow` (installed with `datasets`); text, JSONL and chat JSONL inputs do not.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from . import DataError

__all__ = ["TABLE_SUFFIXES", "is_dataset_dir", "dataset_files", "check_table", "iter_rows"]

TABLE_SUFFIXES = (".parquet", ".arrow")
_ROWS_PER_READ = 1024  # rows per record batch read from Parquet


def _pyarrow():
    try:
        import pyarrow as pa
    except ImportError:
        raise DataError("reading .parquet / .arrow files and datasets folders needs the pyarrow "
                        "package (pip install pyarrow, or datasets, which installs it)") from None
    return pa


def is_dataset_dir(p: Path) -> bool:
    """A folder `datasets.Dataset.save_to_disk` wrote (state.json + dataset_info.json)."""
    return p.is_dir() and (p / "state.json").is_file() and (p / "dataset_info.json").is_file()


def dataset_files(p: Path) -> list[Path]:
    """The `.arrow` shards of a `datasets` folder, in the order its state.json lists them."""
    try:
        state = json.loads((p / "state.json").read_text())
        names = [f["filename"] for f in state["_data_files"]]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise DataError(f"{str(p)!r} looks like a datasets folder but its state.json has no "
                        f"readable _data_files list ({e!r})") from e
    files = [p / n for n in names]
    missing = [str(f) for f in files if not f.is_file()]
    if missing or not files:
        raise DataError(f"datasets folder {str(p)!r}: shard(s) {missing or names} listed in "
                        f"state.json are missing")
    return files


def _open_arrow(path: Path):
    """A reader of record batches over a memory-mapped Arrow IPC file (file or stream format)."""
    pa = _pyarrow()
    source = pa.memory_map(str(path), "r")
    try:
        return pa.ipc.open_file(source)
    except pa.ArrowInvalid:
        source.seek(0)
        try:
            return pa.ipc.open_stream(source)
        except pa.ArrowInvalid as e:
            raise DataError(f"{str(path)!r} is not an Arrow IPC file or stream ({e})") from e


def _schema(path: Path):
    if path.suffix == ".parquet":
        import pyarrow.parquet as pq

        try:
            return pq.ParquetFile(str(path)).schema_arrow
        except Exception as e:  # pyarrow raises ArrowInvalid / OSError subclasses
            raise DataError(f"cannot read the Parquet file {str(path)!r}: {e}") from e
    return _open_arrow(path).schema


def check_table(path: Path, field: str, want: str = "string") -> None:
    """Before any work: `field` is a column of the table, of strings (want="string") or of
    lists (want="list", chat messages)."""
    pa = _pyarrow()
    schema = _schema(path)
    if field not in schema.names:
        raise DataError(f"{path}: the table has no column {field!r} (it has "
                        f"{schema.names[:12]}); pick the text column with --text-field NAME")
    t = schema.field(field).type
    ok = (pa.types.is_string(t) or pa.types.is_large_string(t)) if want == "string" else \
        (pa.types.is_list(t) or pa.types.is_large_list(t))
    if not ok:
        raise DataError(f"{path}: column {field!r} holds {t}, not "
                        f"{'strings' if want == 'string' else 'a list of messages'}")


def iter_rows(path: Path, field: str, batch_bytes: int
              ) -> Iterator[tuple[int, list[Any], int]]:
    """(first row, values of `field`, input file bytes they stand for) in runs of about
    `batch_bytes` of decoded column data; only one record batch (or row group slice) is in
    Arrow memory at a time."""
    if path.suffix == ".parquet":
        import pyarrow.parquet as pq

        # pre_buffer=False: pyarrow's default pre-buffers the column chunks of the whole file
        # (measured: Arrow memory 3.2 / 8.5 / 29.5 MB for 12 / 48 / 192 row groups of 0.5 MB;
        # without it 1.1 MB for each)
        pf = pq.ParquetFile(str(path), pre_buffer=False, buffer_size=1 << 20)
        per_row = path.stat().st_size / max(1, pf.metadata.num_rows)
        batches = ((b.column(0), b.num_rows * per_row)
                   for b in pf.iter_batches(batch_size=_ROWS_PER_READ, columns=[field]))
    else:
        reader = _open_arrow(path)
        if hasattr(reader, "num_record_batches"):
            gen = (reader.get_batch(i) for i in range(reader.num_record_batches))
        else:
            gen = iter(reader)
        batches = ((b.column(field), b.get_total_buffer_size()) for b in gen)
    values: list[Any] = []
    decoded, size = 0, 0.0
    first = 0
    for col, nbytes in batches:
        values += col.to_pylist()
        decoded += col.nbytes
        size += nbytes
        if decoded >= batch_bytes:
            yield first, values, int(size)
            first += len(values)
            values, decoded, size = [], 0, 0.0
    if values:
        yield first, values, int(size)
