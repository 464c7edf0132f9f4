"""Tokenization throughput of `python -m trainer.data prepare` (tokens/s), 1 worker vs N.

Corpus: the running interpreter's standard-library `.py` files (the trainer's default corpus,
no download), as plain-text documents (one file = one document) and as one JSONL file (one
record per source file). Tokenizer: a byte-level BPE trained here on the first 4 MB of that
corpus (cached under --work-dir), or a real one with --tokenizer PATH.

Each configuration (input kind x workers) runs `prepare()` end to end (loading the tokenizer,
listing, reading, encoding, writing FILE.bin + sidecar, starting and joining the workers),
`--repeats` times after one warm-up; reported: median tokens/s of wall time and the ratio
against 1 worker measured in the same run, and median tokens per CPU-second (this process plus
its reaped workers, from getrusage): on a machine shared with other jobs the wall rate swings
with their load, the CPU rate much less, so the CPU rate is the per-core speed and
wall / (N x CPU rate) the parallel efficiency the run actually got. A library reference,
`Tokenizer.encode_batch_fast` on all documents in one call with the tokenizers library's own
thread pool (all cores, no I/O, no EOS), bounds what the pipeline could reach. The outputs of
1 and N workers are checked byte-identical.

    flock /tmp/piper-bench.lock python benchmarks/bench_tokenize.py               # ~8 MB subset
    flock /tmp/piper-bench.lock python benchmarks/bench_tokenize.py --mb 0 --workers 1 2 4

Results: rows appended to tokenize.jsonl (git SHA, CPU, cores, load) in runs/bench/tokenize/
(ignored by git) or `--out DIR`; `--record` appends to benchmarks/results/, the tracked record;
`--no-save` writes no rows.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import sys
import tempfile
import time
from pathlib import Path

from _common import ROOT, add_output_args, cpu_name, git_sha, output_dir

sys.path.insert(0, str(ROOT))

from trainer.data import default_corpus_files  # noqa: E402
from trainer.data.prepare import available_cores, prepare  # noqa: E402


def _cpu() -> str:
    return cpu_name()


def corpus(mb: float) -> list[Path]:
    """The stdlib sources in sorted order, the first `mb` megabytes of them (0 = all)."""
    files, size = [], 0
    for f in default_corpus_files():
        if mb and size >= mb * 1e6:
            break
        try:
            f.read_text(encoding="utf-8")
        except UnicodeDecodeError:  # a handful of stdlib test files are latin-1 on purpose
            continue
        files.append(f)
        size += f.stat().st_size
    return files


def train_tokenizer(work: Path, vocab: int) -> Path:
    """Byte-level BPE with `vocab` ids trained on the first 4 MB of the corpus (cached)."""
    out = work / f"bpe{vocab}" / "tokenizer.json"
    if out.is_file():
        return out
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    texts = [f.read_text(encoding="utf-8") for f in corpus(4)]
    tok.train_from_iterator(texts, trainers.BpeTrainer(
        vocab_size=vocab, special_tokens=["<|endoftext|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    out.parent.mkdir(parents=True, exist_ok=True)
    tok.save(str(out))
    (out.parent / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|endoftext|>"}))
    return out


def cpu_seconds() -> float:
    """User + system CPU of this process and its reaped children (the pool's workers)."""
    s, c = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return s.ru_utime + s.ru_stime + c.ru_utime + c.ru_stime


def library_reference(tok_json: Path, files: list[Path], repeats: int) -> tuple[float, float]:
    """Tokens/s of the tokenizers library alone: encode_batch_fast over all documents, its own
    thread pool, texts already in memory."""
    from tokenizers import Tokenizer

    os.environ.pop("TOKENIZERS_PARALLELISM", None)
    tok = Tokenizer.from_file(str(tok_json))
    texts = [f.read_text(encoding="utf-8") for f in files]
    tok.encode_batch_fast(texts[:50])  # warm-up
    rates, cpu_rates = [], []
    for _ in range(repeats):
        t, c = time.perf_counter(), cpu_seconds()
        n = sum(len(e.ids) for e in tok.encode_batch_fast(texts))
        rates.append(n / (time.perf_counter() - t))
        cpu_rates.append(n / (cpu_seconds() - c))
    return statistics.median(rates), statistics.median(cpu_rates)


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokenizer", default=None, help="a tokenizer.json or folder (default: "
                    "train a byte-level BPE on the corpus)")
    ap.add_argument("--vocab", type=int, default=32_000, help="vocab of the trained BPE")
    ap.add_argument("--mb", type=float, default=8.0, help="corpus megabytes (0: all ~30 MB)")
    ap.add_argument("--workers", type=int, nargs="+", default=None,
                    help="worker counts (default: 1 and the cores available)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--work-dir", default=str(Path(tempfile.gettempdir()) / "piper-bench-tok"))
    ap.add_argument("--no-save", action="store_true")
    add_output_args(ap, "tokenize")
    return ap


def main(argv: list[str] | None = None) -> None:
    args = parser().parse_args(argv)

    work = Path(args.work_dir)
    work.mkdir(parents=True, exist_ok=True)
    tok_json = Path(args.tokenizer) if args.tokenizer else train_tokenizer(work, args.vocab)
    files = corpus(args.mb)
    n_bytes = sum(f.stat().st_size for f in files)
    jsonl = work / f"corpus_{args.mb:g}mb.jsonl"
    if not jsonl.is_file():
        with jsonl.open("w") as fh:
            for f in files:
                fh.write(json.dumps({"text": f.read_text(encoding="utf-8")}) + "\n")
    workers = args.workers or sorted({1, available_cores()})
    common = {"bench": "tokenize", "git": git_sha(), "device": _cpu(),
              "cores": available_cores(), "tokenizer": str(tok_json), "mb": n_bytes / 1e6,
              "documents": len(files), "repeats": args.repeats,
              "time": time.strftime("%Y-%m-%dT%H:%M:%S")}
    print(f"corpus: {len(files)} stdlib files, {n_bytes / 1e6:.1f} MB; tokenizer {tok_json}; "
          f"{common['cores']} cores, load {os.getloadavg()[0]:.1f}")
    rows = []
    for kind, inputs in (("text", [str(f) for f in files]), ("jsonl", [str(jsonl)])):
        base = None
        outputs = {}
        for w in workers:
            out = work / f"out_{kind}_w{w}.bin"
            rates, cpu_rates = [], []
            for r in range(args.repeats + 1):  # run 0 warms the page cache and the imports
                t, c = time.perf_counter(), cpu_seconds()
                meta = prepare(tok_json, inputs, out, workers=w, overwrite=True, progress=False)
                if r:
                    rates.append(meta["n_tokens"] / (time.perf_counter() - t))
                    cpu_rates.append(meta["n_tokens"] / (cpu_seconds() - c))
            outputs[w] = out.read_bytes()
            med, cpu_med = statistics.median(rates), statistics.median(cpu_rates)
            base = base or med
            row = {**common, "input": kind, "workers": w, "tokens": meta["n_tokens"],
                   "dtype": meta["dtype"], "tokens_per_s": med, "tokens_per_s_all": rates,
                   "vs_1_worker": med / base, "tokens_per_cpu_s": cpu_med,
                   "tokens_per_cpu_s_all": cpu_rates, "efficiency": med / (w * cpu_med),
                   "load": os.getloadavg()[0]}
            rows.append(row)
            print(f"{kind:5s} workers={w:2d}: {med:10,.0f} tokens/s wall (runs "
                  f"{', '.join(f'{x:,.0f}' for x in rates)}) x{med / base:.2f} vs 1 worker | "
                  f"{cpu_med:10,.0f} tokens per CPU-s | efficiency {row['efficiency']:.2f} | "
                  f"load {row['load']:.1f}")
        same = len({*outputs.values()}) == 1
        print(f"{kind}: outputs of workers {workers} identical: {same}")
        if not same:
            raise SystemExit("outputs differ between worker counts")
    ref, ref_cpu = library_reference(tok_json, files, args.repeats)
    one = next(r for r in rows if r["input"] == "text" and r["workers"] == 1)
    rows.append({**common, "input": "library encode_batch_fast (threads, in memory)",
                 "workers": common["cores"], "tokens_per_s": ref, "tokens_per_cpu_s": ref_cpu,
                 "load": os.getloadavg()[0]})
    print(f"library reference (encode_batch_fast, {common['cores']} threads, texts in memory): "
          f"{ref:10,.0f} tokens/s wall, {ref_cpu:10,.0f} tokens per CPU-s; the 1-worker text "
          f"pipeline gets {one['tokens_per_cpu_s'] / ref_cpu:.2f} of its per-CPU rate")
    if not args.no_save:
        res = output_dir(args) / "tokenize.jsonl"
        with res.open("a") as fh:
            for row in rows:
                fh.write(json.dumps(row) + "\n")
        print(f"appended {len(rows)} rows to {res}")


if __name__ == "__main__":
    main()
