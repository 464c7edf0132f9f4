"""Document-masked attention: peak memory and time of each kernel (model/attention.py).

One attention call, forward + backward, on q, k, v [B, H, S, hd] of packed documents (lengths
drawn from a seeded geometric distribution of mean --doc-len, cut at S), for each kernel of
--data.doc_attention: `dense` (SDPA with the [B, 1, S, S] boolean mask), `varlen` (one causal
SDPA per document), `flex` (flex_attention's block mask; compiled on CUDA; on CPU only with
--cpu-flex, eagerly, which materialises the scores). Each kernel runs in its own process:
peak memory is getrusage's max RSS after the call minus the RSS just before it (CPU), or
torch.cuda.max_memory_allocated minus the memory allocated before it (CUDA); time is the median
of --repeats calls after one warm-up, and the ratio to dense from the same run. The outputs of
every kernel are compared with dense's (max |difference|).

    flock /tmp/piper-bench.lock python benchmarks/bench_doc_attention.py --seq 4096 --record

Results: rows appended to doc_attention.jsonl in runs/bench/doc_attention/ (ignored by git),
`--out DIR`, or benchmarks/results/ with `--record`.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import resource
import statistics
import subprocess
import sys
import time

from _common import ROOT, add_output_args, cpu_name, git_sha, output_dir, print_written

sys.path.insert(0, str(ROOT))


def _rss_kb() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    return 0


def child(a: argparse.Namespace) -> dict:
    import torch

    from model.attention import DocLayout, sdpa

    torch.set_num_threads(a.threads)
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    g = torch.Generator().manual_seed(0)
    # document lengths: 1 + a geometric count of mean doc_len - 1, from the seeded generator
    # (the same documents in every kernel's process)
    lens: list[int] = []
    while sum(lens) < a.seq:
        u = float(torch.rand((), generator=g))
        lens.append(1 + int(math.log1p(-u) / math.log1p(-1 / a.doc_len)))
    ids = torch.repeat_interleave(torch.arange(len(lens)), torch.tensor(lens))[:a.seq]
    doc = DocLayout(ids[None].expand(a.batch, a.seq).contiguous().to(dev), a.kernel)
    q, k, v = (torch.randn(a.batch, a.heads, a.seq, a.head_dim, generator=g).to(dev)
               .requires_grad_() for _ in range(3))
    grad = torch.randn(a.batch, a.heads, a.seq, a.head_dim, generator=g).to(dev)

    def call():
        o = sdpa(q, k, v, a.head_dim ** -0.5, doc)
        o.backward(grad)
        return o

    if dev.type == "cuda":
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
    else:
        base = _rss_kb() * 1024
    o = call()  # the first call: its peak is the measurement (and the warm-up)
    if dev.type == "cuda":
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated() - base
    else:
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - base
    times = []
    for _ in range(a.repeats):
        for t in (q, k, v):
            t.grad = None
        if dev.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        call()
        if dev.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    torch.save(o.detach().cpu(), a.save)
    return {"kernel": a.kernel, "device": dev.type, "peak_bytes": int(peak),
            "seconds": statistics.median(times), "n_docs": len(lens)}


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seq", type=int, default=4096)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--head-dim", type=int, default=32)
    ap.add_argument("--doc-len", type=float, default=512.0, help="mean document length")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--cpu-flex", action="store_true", help="also run eager flex on CPU (slow)")
    ap.add_argument("--kernel", help=argparse.SUPPRESS)
    ap.add_argument("--save", help=argparse.SUPPRESS)
    add_output_args(ap, "doc_attention")
    return ap


def main() -> int:
    a = parser().parse_args()
    if a.kernel:
        print(json.dumps(child(a)))
        return 0
    import torch

    kernels = ["dense", "varlen"]
    if torch.cuda.is_available() or a.cpu_flex:
        kernels.append("flex")
    out = output_dir(a)
    rows = []
    for kernel in kernels:
        save = out / f"o_{kernel}.pt"
        cmd = [sys.executable, __file__, "--kernel", kernel, "--save", str(save),
               *(f"--{k.replace('_', '-')}={getattr(a, k)}" for k in
                 ("seq", "batch", "heads", "head_dim", "doc_len", "repeats", "threads"))]
        r = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT,
                           env={**os.environ, "PYTHONPATH": str(ROOT)})
        if r.returncode:
            print(r.stderr[-3000:], file=sys.stderr)
            return 1
        rows.append(json.loads(r.stdout.strip().splitlines()[-1]))
    dense = torch.load(out / "o_dense.pt")
    for row in rows:
        row["max_abs_diff_vs_dense"] = float((torch.load(out / f"o_{row['kernel']}.pt")
                                              - dense).abs().max())
        row["peak_vs_dense"] = row["peak_bytes"] / rows[0]["peak_bytes"]
        row["time_vs_dense"] = row["seconds"] / rows[0]["seconds"]
        row.update(seq=a.seq, batch=a.batch, heads=a.heads, head_dim=a.head_dim,
                   doc_len=a.doc_len, repeats=a.repeats, threads=a.threads, sha=git_sha(),
                   cpu=cpu_name(), load=os.getloadavg()[0], time=time.time())
        print(f"{row['kernel']:>6}: peak {row['peak_bytes'] / 2**20:8.1f} MiB "
              f"({row['peak_vs_dense']:.3f}x dense), {row['seconds'] * 1e3:8.1f} ms "
              f"({row['time_vs_dense']:.2f}x), max |o - dense| {row['max_abs_diff_vs_dense']:.2e}")
    for k in kernels:
        (out / f"o_{k}.pt").unlink()
    res = out / "doc_attention.jsonl"
    with res.open("a") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")
    print_written(res)
    return 0


if __name__ == "__main__":
    sys.exit(main())
