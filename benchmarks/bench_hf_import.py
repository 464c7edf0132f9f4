"""Host memory of a Hugging Face import: does each rank hold only its share?

Saves a Mixtral-layout checkpoint with transformers (8 experts x 8 layers by default, fp32,
sharded), launches `train.py --model.hf_path=...` for one step on each layout, and reads what
every rank recorded while it loaded (`<out_dir>/hf_import/rank_R.json`: bytes read, RSS before
the load and the peak RSS during it, reset with /proc/self/clear_refs). Reports per rank:

    read / checkpoint        the fraction of the checkpoint's bytes the rank read
    peak growth / checkpoint (peak RSS during the load - RSS before it) / checkpoint bytes

    python benchmarks/bench_hf_import.py [--d-model 256 --ffn 1024 --layers 8 --experts 8]
        [--layouts ep4,pp2xep2,ep1]

Results: printed, and appended to hf_import.jsonl in runs/bench/hf_import/ (ignored by git) or
`--out DIR`; `--record` appends to benchmarks/results/, the tracked record. One run at a time
(flock /tmp/piper-bench.lock), as it launches 4 processes.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from _common import ROOT, add_output_args, git_sha, output_dir, print_written

LAYOUTS = {"ep4": (1, 4, 4), "pp2xep2": (2, 2, 4), "ep1": (1, 1, 1)}  # pp, ep, processes


def make_checkpoint(path: Path, a: argparse.Namespace) -> int:
    import torch
    import transformers

    torch.manual_seed(0)
    cfg = transformers.MixtralConfig(
        vocab_size=a.vocab, hidden_size=a.d_model, intermediate_size=a.ffn,
        num_hidden_layers=a.layers, num_attention_heads=4, num_key_value_heads=2,
        num_local_experts=a.experts, num_experts_per_tok=2, max_position_embeddings=256)
    transformers.AutoModelForCausalLM.from_config(cfg).save_pretrained(path, max_shard_size="64MB")
    return sum(f.stat().st_size for f in path.glob("*.safetensors"))


def run_layout(name: str, ckpt: Path, data: Path, work: Path) -> list[dict]:
    pp, ep, n = LAYOUTS[name]
    out = work / name
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(n),
           "--master-addr", "127.0.0.1", "--master-port", str(port), "train.py",
           f"--model.hf_path={ckpt}", "--data", str(data), f"--train.out_dir={out}",
           f"--parallel.pp={pp}", f"--parallel.ep={ep}", "--parallel.microbatches=2",
           "--comm.alltoall=flat", "--train.steps=1", "--train.seq_len=32",
           f"--train.global_batch={4 * n}", "--train.eval_every=0", "--train.eval_batches=1",
           "--train.plot=false", "--train.ckpt_every=0"]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    r = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=1800)
    if r.returncode:
        raise SystemExit(f"{name} failed:\n{r.stderr[-3000:]}")
    return [json.loads((out / "hf_import" / f"rank_{i}.json").read_text()) for i in range(n)]


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--d-model", type=int, default=256)
    p.add_argument("--ffn", type=int, default=1024)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--vocab", type=int, default=2048)
    p.add_argument("--layouts", default="ep4,pp2xep2,ep1")
    add_output_args(p, "hf_import")
    return p


def main(argv: list[str] | None = None) -> None:
    a = parser().parse_args(argv)
    bad = [x for x in a.layouts.split(",") if x not in LAYOUTS]
    if bad:
        raise SystemExit(f"--layouts: unknown {bad}; valid: {', '.join(LAYOUTS)}")
    with tempfile.TemporaryDirectory(prefix="bench_hf_import_") as tmp:
        work = Path(tmp)
        t0 = time.perf_counter()
        size = make_checkpoint(work / "ckpt", a)
        print(f"checkpoint: {a.experts} experts x {a.layers} layers, d_model {a.d_model}, ffn "
              f"{a.ffn}: {size / 1e6:.1f} MB (saved in {time.perf_counter() - t0:.0f} s)")
        import numpy as np

        data = work / "bytes.bin"
        np.frombuffer((ROOT / "trainer" / "loop.py").read_bytes(), dtype=np.uint8).astype(
            np.uint16).tofile(data)
        rows = []
        for name in a.layouts.split(","):
            recs = run_layout(name, work / "ckpt", data, work)
            for r in recs:
                row = {"bench": "hf_import", "layout": name, "rank": r["rank"],
                       "checkpoint_bytes": size, "read_bytes": r["bytes"],
                       "read_frac": r["bytes"] / size,
                       "peak_growth_bytes": r["rss_peak"] - r["rss_before"],
                       "peak_growth_frac": (r["rss_peak"] - r["rss_before"]) / size,
                       "git_sha": git_sha(), "host": socket.gethostname()}
                rows.append(row)
                print(f"{name:>8} rank {r['rank']}: read {row['read_bytes'] / 1e6:7.1f} MB "
                      f"({100 * row['read_frac']:5.1f} %), peak RSS growth during the load "
                      f"{row['peak_growth_bytes'] / 1e6:7.1f} MB "
                      f"({100 * row['peak_growth_frac']:5.1f} % of the checkpoint)")
    res = output_dir(a) / "hf_import.jsonl"
    with open(res, "a") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")
    print(f"appended {len(rows)} rows")
    print_written(res)


if __name__ == "__main__":
    main()
