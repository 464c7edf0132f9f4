"""Tokenize text into a `.bin` of token ids plus its JSON sidecar (`python -m trainer.data prepare`).

    python -m trainer.data prepare --tokenizer CKPT_DIR --input corpus/ --input extra.jsonl \\
        --text-field text --workers 8 --out data/train.bin

Documents: one plain-text file, or one record of a `.jsonl`, `.parquet` or `.arrow` file, or of
a `datasets` folder (`Dataset.save_to_disk`): its `--text-field` (default "text"; tables are
streamed by record batch, trainer.data.tables). With `--chat` a record's field (default
"messages") is a conversation, rendered by the tokenizer's chat template, and a loss mask
`FILE.mask` (uint8, 1 on assistant tokens) is written beside the ids (trainer.data.chat).
Each other document is encoded by the Hugging Face `tokenizers` library exactly as
`Tokenizer.encode(doc)` does (the tokenizer's own special tokens included; truncation and padding
saved in tokenizer.json are switched off) and followed by the EOS id, unless the tokenizer's
post-processor already ended it with EOS. Documents keep the order of the inputs (folders walked
in sorted path order, hidden entries and binary files skipped), so the output does not
depend on `--workers`.

Ids are stored as uint16 when the vocabulary fits (<= 65,536 ids) and uint32 otherwise. The
sidecar FILE.json (format in `trainer.data.read_sidecar`) records dtype, vocab_size, eos_id,
the document and token counts, the tokenizer's path and sha256, and the inputs.

Parallelism: input is cut into batches of about `batch_bytes` (whole text files, or runs of
JSONL lines); `--workers` forked processes each encode whole batches with a single-threaded
tokenizer (TOKENIZERS_PARALLELISM=false, so N workers use N cores); the parent writes results in
batch order, with at most 4 batches per worker in flight (bounded memory on huge inputs).

Writes are atomic: FILE.bin.part and FILE.json.part are written in full, then renamed (the bin
first, the sidecar last). An existing FILE.bin or FILE.json is refused unless `overwrite`.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import hashlib
import itertools
import json
import multiprocessing as mp
import os
import sys
import time
from collections.abc import Generator, Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from . import SIDECAR_FORMAT, SIDECAR_VERSION, TOKEN_DTYPES, DataError, mask_path, sidecar_path
from .chat import chat_ids, check_messages, load_chat_tokenizer
from .tables import TABLE_SUFFIXES, check_table, dataset_files, is_dataset_dir, iter_rows

__all__ = ["available_cores", "prepare", "resolve_tokenizer", "resolve_eos", "list_inputs", "main"]

UINT16_VOCAB = 1 << 16  # ids 0..65535
BATCH_BYTES = 1 << 20  # ~1 MB of text per task: ~1 s of one core at ~250k tokens per CPU-s
_IN_FLIGHT_PER_WORKER = 4


def resolve_tokenizer(path: str | Path) -> Path:
    """`path` is a tokenizer.json or a folder holding one (e.g. a Hugging Face checkpoint)."""
    p = Path(path)
    if p.is_dir():
        p = p / "tokenizer.json"
    if not p.is_file():
        raise DataError(
            f"no tokenizer.json at {str(path)!r}; pass --tokenizer as a tokenizer.json file or a "
            f"folder holding one (a Hugging Face checkpoint or tokenizer folder)"
        )
    return p


def _load_tokenizer(tok_json: Path):
    from tokenizers import Tokenizer

    try:
        tok = Tokenizer.from_file(str(tok_json))
    except Exception as e:  # the Rust side raises a plain Exception for a malformed file
        raise DataError(f"cannot load the tokenizer {str(tok_json)!r}: {e}") from e
    # a saved max_length would cut every document silently; padding would insert pad ids
    tok.no_truncation()
    tok.no_padding()
    return tok


def _vocab_size(tok) -> int:
    """Number of ids the tokenizer can emit: max id + 1 (added tokens included)."""
    return max(tok.get_vocab_size(with_added_tokens=True),
               max(tok.get_vocab(with_added_tokens=True).values(), default=-1) + 1)


def resolve_eos(tok, tok_json: Path, eos: str | None) -> tuple[str, int]:
    """EOS token and id: `eos` when given, else `eos_token` of the tokenizer_config.json beside
    tok_json; a clear error when neither names a token of this vocabulary."""
    where = "--eos"
    if eos is None:
        cfg = tok_json.with_name("tokenizer_config.json")
        if cfg.is_file():
            try:
                eos = json.loads(cfg.read_text()).get("eos_token")
            except (OSError, UnicodeDecodeError, json.JSONDecodeError, AttributeError) as e:
                raise DataError(f"cannot read {str(cfg)!r}: {e}; pass --eos TOKEN") from e
            if isinstance(eos, dict):  # older transformers save AddedToken as {"content": ...}
                eos = eos.get("content")
            where = str(cfg)
        if not eos:
            raise DataError(
                f"no EOS token: {str(cfg)!r} "
                f"{'has no eos_token' if cfg.is_file() else 'does not exist'}; pass the "
                f"end-of-document token with --eos TOKEN (e.g. --eos '</s>' or "
                f"--eos '<|endoftext|>')"
            )
    eos_id = tok.token_to_id(eos)
    if eos_id is None:
        raise DataError(
            f"EOS token {eos!r} (from {where}) is not in the vocabulary of {str(tok_json)!r}; "
            f"pass a token of this tokenizer with --eos TOKEN"
        )
    return eos, eos_id


def _looks_binary(path: Path) -> bool:
    """A NUL byte in the first 4 KB (the byte-level loader's rule): .pyc, images, archives."""
    with path.open("rb") as f:
        return b"\x00" in f.read(4096)


def list_inputs(inputs: list[str], exclude: tuple[Path, ...] = ()) -> tuple[list[Path],
                                                                           list[Path]]:
    """(files, skipped) of `inputs` in order: a file as is, a folder's files recursively in
    sorted path order, hidden files and folders skipped, binary files (`_looks_binary`) skipped
    and returned as `skipped`; `exclude` (the output files) left out. A `.bin` among them is
    refused (it is token ids, e.g. an earlier output, not text)."""
    if not inputs:
        raise DataError("no --input given; pass text files, .jsonl files or folders of them")
    skip = {p.resolve() for p in exclude}
    files: list[Path] = []
    skipped: list[Path] = []
    for name in inputs:
        p = Path(name)
        if p.is_file():
            found = [p]
        elif is_dataset_dir(p):  # a datasets.save_to_disk folder: its Arrow shards, in order
            files.extend(dataset_files(p))
            continue
        elif p.is_dir():
            found = sorted(f for f in p.rglob("*") if f.is_file()
                           and not any(part.startswith(".") for part in f.relative_to(p).parts))
            found = [f for f in found if f.resolve() not in skip]
            if not found:
                raise DataError(f"input folder {name!r} contains no files (hidden ones skipped)")
        else:
            raise DataError(
                f"input {name!r} does not exist; pass text files, .jsonl files or folders of them"
            )
        binary = [f for f in found if f.suffix == ".bin"]
        if binary:
            raise DataError(
                f"input {name!r} holds {str(binary[0])!r}, a .bin of token ids, not text; "
                f"tokenize text files or .jsonl files only"
            )
        if p.is_dir():
            binary_files = {f for f in found if f.suffix not in TABLE_SUFFIXES
                            and _looks_binary(f)}
            skipped += [f for f in found if f in binary_files]
            found = [f for f in found if f not in binary_files]
            if not found:
                raise DataError(f"input folder {name!r} holds only binary files, no text")
        files.extend(found)
    return files, skipped


def _check_first_record(path: Path, field: str, chat: bool = False) -> bool:
    """Fail before any work when the first record of a JSONL file (or the schema of a table)
    lacks `field`, or (chat) its first conversation is malformed; False when the file has no
    record at all."""
    if path.suffix in TABLE_SUFFIXES:
        check_table(path, field, "list" if chat else "string")
        return True
    with path.open("rb") as f:
        for line_no, line in enumerate(f, 1):
            if line.strip():
                v = _jsonl_text(line, field, path, line_no, chat)
                if chat:
                    check_messages(v, f"{path}:{line_no}")
                return True
    return False


def _jsonl_text(line: bytes, field: str, path: Path | str, line_no: int, chat: bool = False):
    try:
        rec = json.loads(line)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise DataError(f"{path}:{line_no}: not a JSON record ({e})") from e
    if not isinstance(rec, dict) or field not in rec:
        keys = sorted(rec)[:8] if isinstance(rec, dict) else type(rec).__name__
        raise DataError(
            f"{path}:{line_no}: the record has no field {field!r} (it has {keys}); pick the "
            f"text field with --text-field NAME"
        )
    text = rec[field]
    if chat:
        return text  # the messages, checked by chat.check_messages
    if not isinstance(text, str):
        raise DataError(
            f"{path}:{line_no}: field {field!r} is {type(text).__name__}, not a string"
        )
    return text


@dataclass
class _Task:
    """One batch of documents: whole text files, or JSONL lines from `first_line` on."""

    kind: str  # "text" | "jsonl" | "rows" (values of a table's column)
    paths: list[str]  # text: the files; jsonl, rows: [the file]
    n_bytes: int
    first_line: int = 0  # jsonl: line number (1-based); rows: row index (0-based)
    lines: list[bytes] | None = None
    values: list | None = None


def _tasks(files: list[Path], batch_bytes: int, field: str) -> Iterator[_Task]:
    text: list[str] = []
    size = 0
    for f in files:
        if f.suffix in TABLE_SUFFIXES:
            if text:
                yield _Task("text", text, size)
                text, size = [], 0
            for first, values, nbytes in iter_rows(f, field, batch_bytes):
                yield _Task("rows", [str(f)], nbytes, first, values=values)
        elif f.suffix == ".jsonl":
            if text:
                yield _Task("text", text, size)
                text, size = [], 0
            with f.open("rb") as fh:
                lines: list[bytes] = []
                first, n = 1, 0
                for line_no, line in enumerate(fh, 1):
                    lines.append(line)
                    n += len(line)
                    if n >= batch_bytes:
                        yield _Task("jsonl", [str(f)], n, first, lines)
                        lines, first, n = [], line_no + 1, 0
                if lines:
                    yield _Task("jsonl", [str(f)], n, first, lines)
        else:
            text.append(str(f))
            size += f.stat().st_size
            if size >= batch_bytes:
                yield _Task("text", text, size)
                text, size = [], 0
    if text:
        yield _Task("text", text, size)


# Per-worker state, set once by _init_worker in each forked process (the pool's initializer
# pattern); the in-process path (workers=1) sets it the same way and clears it afterwards.
_W: dict = {}


def _init_worker(tok_json: str, eos_id: int, dtype: str, field: str, chat: bool = False,
                 tok=None) -> None:
    os.environ["TOKENIZERS_PARALLELISM"] = "false"  # one core per worker
    if chat and tok is None:
        tok = load_chat_tokenizer(tok_json)
    _W.update(tok=tok or _load_tokenizer(Path(tok_json)), eos_id=eos_id,
              dtype=TOKEN_DTYPES[dtype], field=field, chat=chat)


def _encode_chat(task: _Task) -> tuple[np.ndarray, np.ndarray, int, int]:
    """Ids and loss mask of the task's conversations, each followed by EOS (mask 0) unless
    the template ended it with EOS."""
    tok, eos_id = _W["tok"], _W["eos_id"]
    if task.kind == "rows":
        assert task.values is not None
        recs = [(v, f"{task.paths[0]}: row {task.first_line + i}")
                for i, v in enumerate(task.values)]
    else:
        assert task.lines is not None
        recs = [(_jsonl_text(line, _W["field"], task.paths[0], task.first_line + i, True),
                 f"{task.paths[0]}:{task.first_line + i}")
                for i, line in enumerate(task.lines) if line.strip()]
    ids_all: list[int] = []
    mask_all: list[int] = []
    for messages, where in recs:
        ids, mask = chat_ids(tok, check_messages(messages, where), where)
        if not ids or ids[-1] != eos_id:
            ids.append(eos_id)
            mask.append(0)
        ids_all += ids
        mask_all += mask
    return (np.array(ids_all, dtype=_W["dtype"]), np.array(mask_all, dtype=np.uint8),
            len(recs), task.n_bytes)


def _encode(task: _Task) -> tuple[np.ndarray, np.ndarray | None, int, int]:
    """Ids of the task's documents, each followed by EOS; (ids, loss mask (chat) or None,
    n_documents, n_bytes)."""
    if _W["chat"]:
        return _encode_chat(task)
    tok, eos_id = _W["tok"], _W["eos_id"]
    if task.kind == "rows":
        assert task.values is not None
        docs = task.values
        for i, v in enumerate(docs):
            if not isinstance(v, str):
                raise DataError(f"{task.paths[0]}: row {task.first_line + i}: column "
                                f"{_W['field']!r} is {type(v).__name__}, not a string")
    elif task.kind == "text":
        docs = []
        for p in task.paths:
            try:
                docs.append(Path(p).read_text(encoding="utf-8"))
            except UnicodeDecodeError as e:
                raise DataError(
                    f"{p} is not UTF-8 text ({e}); tokenize text files only (or .jsonl records)"
                ) from e
    else:
        assert task.lines is not None
        docs = [_jsonl_text(line, _W["field"], task.paths[0], task.first_line + i)
                for i, line in enumerate(task.lines) if line.strip()]
    encode = getattr(tok, "encode_batch_fast", tok.encode_batch)  # _fast: tokenizers >= 0.20
    seqs = [e.ids for e in encode(docs)]
    for ids in seqs:
        if not ids or ids[-1] != eos_id:
            ids.append(eos_id)
    n = sum(map(len, seqs))
    out = np.fromiter(itertools.chain.from_iterable(seqs), dtype=_W["dtype"], count=n)
    return out, None, len(docs), task.n_bytes


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def available_cores() -> int:
    """The cores this process may run on (its affinity mask; the CPU count elsewhere)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def prepare(tokenizer: str | Path, inputs: list[str], out: str | Path, field: str | None = None,
            workers: int | None = None, eos: str | None = None, overwrite: bool = False,
            progress: bool = True, batch_bytes: int = BATCH_BYTES, chat: bool = False) -> dict:
    """Tokenize `inputs` into `out` (a .bin) and its sidecar; returns the sidecar dict.
    `field`: the JSONL field / table column (default "text"; "messages" with `chat`).
    `chat`: records are conversations, rendered by the tokenizer's chat template, and a loss
    mask FILE.mask (1 = assistant token) is written beside the ids (trainer.data.chat).

    Every argument is checked before any work; on an error during the run the partial files
    are removed and `out` is left as it was."""
    out = Path(out)
    if field is None:
        field = "messages" if chat else "text"
    if out.suffix != ".bin":
        raise DataError(f"--out {str(out)!r} must end in .bin (the trainer reads FILE.bin)")
    side, mask_out = sidecar_path(out), mask_path(out)
    if not overwrite:
        for p in (out, side, mask_out):
            if p.exists():
                raise DataError(f"{str(p)!r} already exists; pass --overwrite to replace it")
    if workers is None:
        workers = available_cores()
    if workers < 1:
        raise DataError(f"--workers={workers} must be >= 1")
    if batch_bytes < 1:
        raise DataError(f"batch_bytes={batch_bytes} must be >= 1")
    tok_json = resolve_tokenizer(tokenizer)
    tok = _load_tokenizer(tok_json)
    eos_token, eos_id = resolve_eos(tok, tok_json, eos)
    vocab_size = _vocab_size(tok)
    dtype = "uint16" if vocab_size <= UINT16_VOCAB else "uint32"
    part = out.with_name(out.name + ".part")
    side_part = side.with_name(side.name + ".part")
    mask_part = mask_out.with_name(mask_out.name + ".part")
    files, skipped = list_inputs(inputs, exclude=(out, side, part, side_part, mask_out,
                                                  mask_part))
    records = [f for f in files if f.suffix == ".jsonl" or f.suffix in TABLE_SUFFIXES]
    if chat and len(records) < len(files):
        plain = next(f for f in files if f not in records)
        raise DataError(f"prepare --chat reads conversations from .jsonl / .parquet / .arrow "
                        f"records (a {field!r} list of {{role, content}}); {str(plain)!r} is a "
                        f"plain text file")
    has_docs = [f not in records or _check_first_record(f, field, chat) for f in files]
    if not any(has_docs):
        raise DataError(f"the inputs {inputs} hold no documents (only empty .jsonl files)")
    chat_tok = load_chat_tokenizer(tok_json) if chat else None
    total_bytes = sum(f.stat().st_size for f in files)

    out.parent.mkdir(parents=True, exist_ok=True)
    n_docs = n_tokens = n_masked = 0
    t0 = time.perf_counter()
    init = (str(tok_json), eos_id, dtype, field, chat)
    try:
        run = _run(files, init, workers, batch_bytes, total_bytes, progress,
                   chat_tok if chat else tok, field)
        with part.open("wb") as fh, contextlib.closing(run), \
                (mask_part.open("wb") if chat else contextlib.nullcontext()) as mh:
            for ids, mask, docs, _ in run:
                ids.tofile(fh)
                if mh is not None and mask is not None:
                    mask.tofile(mh)
                    n_masked += int(mask.sum())
                n_docs += docs
                n_tokens += len(ids)
            for h in (fh, mh):
                if h is not None:
                    h.flush()
                    os.fsync(h.fileno())
        seconds = time.perf_counter() - t0
        meta = {
            "format": SIDECAR_FORMAT,
            "version": SIDECAR_VERSION,
            "dtype": dtype,
            "vocab_size": vocab_size,
            "eos_id": eos_id,
            "eos_token": eos_token,
            "n_documents": n_docs,
            "n_tokens": n_tokens,
            "tokenizer": {"path": str(tok_json.resolve()), "sha256": _sha256(tok_json)},
            "inputs": [str(Path(i).resolve()) for i in inputs],
            "n_files": len(files),
            "n_skipped_binary": len(skipped),
            "skipped_binary": [str(f) for f in skipped[:20]],  # the first 20
            "n_bytes": total_bytes,
            "field": field if records else None,
        }
        if chat:
            meta.update(chat=True, loss_mask={"file": mask_out.name, "dtype": "uint8"},
                        n_loss_tokens=n_masked)
        side_part.write_text(json.dumps(meta, indent=2) + "\n")
        if overwrite:
            side.unlink(missing_ok=True)  # never pair the new bin with the old sidecar
            mask_out.unlink(missing_ok=True)
        os.replace(part, out)
        if chat:
            os.replace(mask_part, mask_out)
        os.replace(side_part, side)
    except BaseException:
        for f in (part, side_part, mask_part):
            f.unlink(missing_ok=True)
        raise
    meta["seconds"] = seconds  # returned for callers (benchmarks), not stored
    return meta


def _run(files: list[Path], init: tuple[str, int, str, str, bool], workers: int,
         batch_bytes: int, total_bytes: int, progress: bool, tok, field: str
         ) -> Generator[tuple[np.ndarray, np.ndarray | None, int, int], None, None]:
    """Results of every task in task order, with a progress bar over input bytes; workers=1
    encodes in this process with the already loaded `tok`."""
    from tqdm import tqdm

    tasks = _tasks(files, batch_bytes, field)
    if workers == 1:
        old = os.environ.get("TOKENIZERS_PARALLELISM")
        _init_worker(*init, tok=tok)
        results: Iterator = map(_encode, tasks)
        pool = None
    else:
        # fork: the workers share the parent's imports (spawn would re-import torch per worker)
        ctx = mp.get_context("fork" if "fork" in mp.get_all_start_methods() else "spawn")
        pool = ctx.Pool(workers, initializer=_init_worker, initargs=init)
        results = _bounded_imap(pool, tasks, workers * _IN_FLIGHT_PER_WORKER)
    bar = tqdm(total=total_bytes, unit="B", unit_scale=True, desc="tokenizing",
               disable=not progress, file=sys.stderr)
    n_tokens = 0
    try:
        for ids, mask, docs, nbytes in results:
            n_tokens += len(ids)
            bar.update(nbytes)
            bar.set_postfix(tokens=f"{n_tokens:,}", refresh=False)
            yield ids, mask, docs, nbytes
    finally:
        bar.close()
        if pool is None:
            _W.clear()
            if old is None:
                os.environ.pop("TOKENIZERS_PARALLELISM", None)
            else:
                os.environ["TOKENIZERS_PARALLELISM"] = old
        else:
            pool.terminate()
            pool.join()


def _bounded_imap(pool, tasks: Iterator[_Task], depth: int) -> Iterator:
    """Ordered like Pool.imap, but reads ahead at most `depth` tasks (imap drains its input)."""
    pending: collections.deque = collections.deque()
    for task in tasks:
        pending.append(pool.apply_async(_encode, (task,)))
        if len(pending) >= depth:
            yield pending.popleft().get()
    while pending:
        yield pending.popleft().get()


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m trainer.data",
                                 description="Data tools for piper-moe.")
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("prepare", help="tokenize text into FILE.bin + FILE.json",
                       description=__doc__.split("\n\n")[2],
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokenizer", required=True,
                   help="tokenizer.json, or a folder holding one (e.g. a checkpoint folder)")
    p.add_argument("--input", action="append", required=True, metavar="FILE_OR_DIR",
                   help="text file, .jsonl file or folder of them (repeatable)")
    p.add_argument("--out", required=True, metavar="FILE.bin")
    p.add_argument("--text-field", "--field", dest="field", default=None, metavar="NAME",
                   help="JSONL field / table column holding the text (default: text; with "
                        "--chat: messages)")
    p.add_argument("--chat", action="store_true",
                   help="records are conversations (a list of {role, content}): apply the "
                        "tokenizer's chat template and write a loss mask FILE.mask keeping the "
                        "assistant turns")
    p.add_argument("--eos", default=None, metavar="TOKEN",
                   help="end-of-document token (default: eos_token of tokenizer_config.json)")
    p.add_argument("--workers", type=int, default=None,
                   help=f"processes (default: the cores available, {available_cores()} here)")
    p.add_argument("--overwrite", action="store_true", help="replace an existing FILE.bin")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    from .order import add_parser

    add_parser(sub)
    return ap


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.cmd == "order":
        from .order import run

        try:
            return run(args)
        except DataError as e:
            print(f"error: {e}", file=sys.stderr)
            return 1
    try:
        meta = prepare(args.tokenizer, args.input, args.out, field=args.field,
                       workers=args.workers, eos=args.eos, overwrite=args.overwrite,
                       progress=not args.no_progress, chat=args.chat)
    except DataError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    s = meta["seconds"]
    print(f"{args.out}: {meta['n_tokens']:,} tokens ({meta['dtype']}, vocab "
          f"{meta['vocab_size']:,}, eos {meta['eos_token']!r}={meta['eos_id']}) from "
          f"{meta['n_documents']:,} documents in {s:.1f} s "
          f"({meta['n_tokens'] / max(s, 1e-9):,.0f} tokens/s); sidecar {sidecar_path(args.out)}")
    if meta.get("chat"):
        print(f"loss mask {mask_path(args.out)}: {meta['n_loss_tokens']:,} of "
              f"{meta['n_tokens']:,} tokens in assistant turns (train with "
              f"--data.loss_mask=true)")
    if meta["n_skipped_binary"]:
        print(f"skipped {meta['n_skipped_binary']} binary files (the first listed in the "
              f"sidecar), e.g. {meta['skipped_binary'][0]}")
    return 0
