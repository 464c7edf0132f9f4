"""Grouped GEMM throughput: Triton vs torch._grouped_mm vs a per-expert loop vs one dense GEMM.

Shapes are the expert GEMMs (x [M, D] @ w1 [E, D, F]) of model presets (default Mixtral-8x7B,
Qwen3-235B-A22B, DeepSeek-V3) with M = tokens * top_k rows, split over experts either evenly
("balanced") or by a Zipf law over a random expert order ("zipf"). The dense GEMM has the same
FLOPs ([M, D] @ [D, F]): the roof a grouped GEMM is measured against. Ops: "fwd" (x @ w) and
"dw" (per-expert x^T dy, the weight gradient).

GPU (the claims): ``python benchmarks/bench_grouped_gemm.py [--out DIR]``.
CPU (how piper_kernels/cpu.py picked its path; shapes shrunk by --shrink):
``python benchmarks/bench_grouped_gemm.py --allow-cpu --shrink 8 --tokens 1024``.
Writes JSON rows to DIR/bench_grouped_gemm.jsonl and a plot DIR/bench_grouped_gemm.png; DIR
is runs/bench/grouped_gemm/ (ignored by git) unless `--out DIR` is given, and `--record` makes
it benchmarks/results/, the tracked record.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from _common import add_output_args, git_sha, output_dir  # noqa: E402

from piper_kernels import cpu as cpu_kernels  # noqa: E402
from piper_kernels import grouped_gemm  # noqa: E402

DEFAULT_PRESETS = ["mixtral-8x7b", "qwen3-235b-a22b", "deepseek-v3"]


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    import platform
    return f"cpu:{platform.processor() or platform.machine()}:{torch.get_num_threads()}threads"


def expert_counts(M: int, E: int, dist: str, zipf_s: float, gen: torch.Generator) -> torch.Tensor:
    """Rows per expert summing to M: even split, or Zipf(s) over a random expert order."""
    if dist == "balanced":
        c = torch.full((E,), M // E, dtype=torch.long)
        c[: M - int(c.sum())] += 1
        return c
    ranks = torch.randperm(E, generator=gen).double() + 1.0
    p = ranks.pow(-zipf_s)
    c = torch.floor(p / p.sum() * M).long()
    c[int(torch.argmax(p))] += M - int(c.sum())
    return c


def time_fn(fn: Callable[[], object], device: torch.device, warmup: int, repeats: int) -> float:
    """Median seconds of ``repeats`` calls after ``warmup`` calls."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize(device)
            times.append(start.elapsed_time(end) / 1e3)
        else:
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def padded_bmm(x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """Candidate: scatter rows into [E, max_count, K], one bmm, gather back (pads zeros)."""
    ends = offs.long()
    starts = torch.cat([ends.new_zeros(1), ends[:-1]])
    counts = ends - starts
    E, C = w.shape[0], int(counts.max())
    expert = torch.repeat_interleave(torch.arange(E, device=x.device), counts)
    dst = expert * C + torch.arange(int(ends[-1]), device=x.device) - starts[expert]
    buf = x.new_zeros(E * C, x.shape[1]).index_copy_(0, dst, x[: int(ends[-1])])
    y = x.new_zeros(x.shape[0], w.shape[2])
    y[: int(ends[-1])] = torch.bmm(buf.view(E, C, -1), w).view(E * C, -1).index_select(0, dst)
    return y


def methods(device: torch.device, op: str) -> dict[str, Callable]:
    """name -> fn(x, w_or_dy, offs) for this device and op."""
    if op == "fwd":
        m: dict[str, Callable] = {}
        if device.type == "cuda":
            m["triton"] = lambda x, w, o: grouped_gemm(x, w, o, backend="triton")
        else:
            m["ours-cpu"] = lambda x, w, o: grouped_gemm(x, w, o, backend="torch")
            m["padded-bmm"] = padded_bmm
        m["torch._grouped_mm"] = lambda x, w, o: torch._grouped_mm(x, w, offs=o)
        m["loop"] = cpu_kernels.gmm_loop
        return m
    m = {}
    if device.type == "cuda":
        from piper_kernels import grouped_gemm_triton as tri
        m["triton"] = tri.gmm_dw
    else:
        m["ours-cpu"] = cpu_kernels.gmm_dw
    m["torch._grouped_mm"] = lambda x, dy, o: torch._grouped_mm(x.t(), dy, offs=o)
    m["loop"] = cpu_kernels.gmm_dw_loop
    return m


def bench_case(name: str, dist: str, counts: torch.Tensor, D: int, F: int, dtype: torch.dtype,
               device: torch.device, args: argparse.Namespace, meta: dict) -> list[dict]:
    """Every method on one (preset, distribution) problem; dense GEMM timed alongside."""
    M, E = int(counts.sum()), counts.numel()
    offs = torch.cumsum(counts, 0, dtype=torch.int32).to(device)
    x = torch.randn(M, D, device=device, dtype=dtype)
    w = torch.randn(E, D, F, device=device, dtype=dtype) / D**0.5
    dy = torch.randn(M, F, device=device, dtype=dtype)
    dense_w = w[0].contiguous()
    flops = 2.0 * M * D * F
    t_dense = time_fn(lambda: x @ dense_w, device, args.warmup, args.repeats)
    # torch._grouped_mm's CUDA kernels want w column-major per expert (the layout of an
    # nn.Linear weight seen transposed, as transformers and torchtitan pass it).
    w_cm = w.transpose(1, 2).contiguous().transpose(1, 2) if device.type == "cuda" else w
    rows = []
    for op in ("fwd", "dw"):
        for meth, fn in methods(device, op).items():
            waste = E * int(counts.max()) / max(M, 1)
            if meth == "padded-bmm" and waste > 4:
                print(f"  skip padded-bmm {name}/{dist}: padding multiplies the work by {waste:.0f}")
                continue
            second = dy if op == "dw" else (w_cm if meth == "torch._grouped_mm" else w)
            try:
                t = time_fn(lambda fn=fn, s=second: fn(x, s, offs), device, args.warmup, args.repeats)
            except (RuntimeError, NotImplementedError) as exc:  # e.g. _grouped_mm needs sm90
                print(f"  skip {meth} {op} {name}/{dist}: {str(exc).splitlines()[0][:90]}")
                continue
            r = dict(bench="grouped_gemm", preset=name, dist=dist, op=op, method=meth, M=M, K=D,
                     N=F, E=E, max_rows=int(counts.max()), dtype=str(dtype), seconds=t,
                     tflops=flops / t / 1e12, vs_dense=t_dense / t, dense_seconds=t_dense, **meta)
            rows.append(r)
            print(f"{name:16s} {dist:8s} {op:3s} {meth:18s} M={M:6d} K={D:5d} N={F:5d} E={E:3d} "
                  f"{t * 1e3:9.2f} ms {r['tflops']:7.2f} TFLOPS {r['vs_dense']:5.2f}x dense", flush=True)
    return rows


def run(args: argparse.Namespace) -> list[dict]:
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = getattr(torch, args.dtype) if device.type == "cuda" else torch.float32
    from model import presets  # lazy: only the shapes come from the model package

    gen = torch.Generator().manual_seed(0)
    meta = dict(device=device_name(device), git=git_sha(), shrink=args.shrink)
    rows: list[dict] = []
    for name in args.presets:
        cfg = presets.get(name)
        D, F = cfg.d_model // args.shrink, cfg.moe_ffn_dim // args.shrink
        M = args.tokens * cfg.top_k
        for dist in ("balanced", "zipf"):
            counts = expert_counts(M, cfg.n_routed_experts, dist, args.zipf_s, gen)
            rows += bench_case(name, dist, counts, D, F, dtype, device, args, meta)
            if device.type == "cuda":
                torch.cuda.empty_cache()  # DeepSeek-V3 weights alone are 7.5 GB in bf16
    return rows


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fwd = [r for r in rows if r["op"] == "fwd"]
    cases = sorted({(r["preset"], r["dist"]) for r in fwd}, key=str)
    meths = sorted({r["method"] for r in fwd})
    fig, ax = plt.subplots(figsize=(10, 4))
    width = 0.8 / max(1, len(meths))
    for i, m in enumerate(meths):
        vals = [next((r["vs_dense"] for r in fwd if (r["preset"], r["dist"]) == c
                      and r["method"] == m), 0.0) for c in cases]
        ax.bar([j + i * width for j in range(len(cases))], vals, width, label=m)
    ax.axhline(1.0, color="k", lw=0.8)
    ax.set_xticks([j + 0.4 - width / 2 for j in range(len(cases))])
    ax.set_xticklabels([f"{p}\n{d}" for p, d in cases], fontsize=8)
    ax.set_ylabel("throughput / dense GEMM of equal FLOPs")
    ax.set_title(f"grouped GEMM forward, {fwd[0]['device'] if fwd else ''}")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--presets", nargs="+", default=DEFAULT_PRESETS)
    p.add_argument("--tokens", type=int, default=8192, help="tokens per step (rows = tokens * top_k)")
    p.add_argument("--shrink", type=int, default=1, help="divide d_model and moe_ffn_dim (CPU runs)")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    p.add_argument("--zipf-s", type=float, default=1.2)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--repeats", type=int, default=10)
    p.add_argument("--allow-cpu", action="store_true", help="run on CPU (fp32) instead of failing")
    p.add_argument("--threads", type=int, default=None,
                   help="torch CPU threads (default: torch's choice; 1 is steadier on a busy machine)")
    add_output_args(p, "grouped_gemm")
    return p


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    if not torch.cuda.is_available() and not args.allow_cpu:
        print("bench_grouped_gemm.py needs a CUDA/ROCm GPU (pass --allow-cpu to compare the CPU "
              "paths instead)", file=sys.stderr)
        return 2
    rows = run(args)
    out = output_dir(args)
    with open(out / "bench_grouped_gemm.jsonl", "a") as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")
    if rows:
        plot(rows, out / "bench_grouped_gemm.png")
    print(f"wrote {len(rows)} rows to {out / 'bench_grouped_gemm.jsonl'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
