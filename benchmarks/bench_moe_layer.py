"""MoE layer forward + backward: ours (model.moe.MoELayer on piper_kernels/) vs transformers vs dense.

Three contenders, same weights, same input, fp32 (CPU) or --dtype (GPU):
- ours:   ``model.moe.MoELayer`` (router -> piper_kernels.permute -> 3 grouped GEMMs -> unpermute)
- hf:     ``transformers`` ``MixtralSparseMoeBlock`` in its default experts implementation
          (the one a model built from its config picks; "grouped_mm" in transformers 5.x), and
          the per-expert "eager" loop as a second row
- dense:  one SwiGLU over the same T*k rows (no routing, no gathers): the compute no MoE layer
          can beat, so ours/dense is the overhead of routing and grouping.
Targets (issue 3): ours >= 1.8x faster than hf default; ours <= 1.3x dense.

``python benchmarks/bench_moe_layer.py`` runs the Mixtral-like shape (d=1024, f=3584, E=8,
k=2, T=2048) and the fine-grained one (E=64, k=6, f=512). The contenders run round-robin, so
a noisy shared machine slows them alike. Writes DIR/bench_moe_layer.jsonl and .png: DIR is
runs/bench/moe_layer/ (ignored by git), `--out DIR`, or with `--record` benchmarks/results/,
the tracked record.
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
sys.path.insert(0, str(ROOT / "benchmarks"))

from _common import add_output_args, git_sha, output_dir, print_written  # noqa: E402
from bench_grouped_gemm import device_name  # noqa: E402

SHAPES = {  # name: (d, f, E, k)
    "mixtral-like": (1024, 3584, 8, 2),
    "fine-grained": (1024, 512, 64, 6),
}


def build(d: int, f: int, E: int, k: int, device: torch.device, dtype: torch.dtype, seed: int):
    """(ours, hf_default, hf_eager, dense, hf_impl_name) sharing one set of weights."""
    from transformers import MixtralConfig
    from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock

    from model.config import ModelConfig
    from model.moe import MoELayer, SwiGLU

    torch.manual_seed(seed)
    hcfg = MixtralConfig(hidden_size=d, intermediate_size=f, num_local_experts=E,
                         num_experts_per_tok=k, router_jitter_noise=0.0, num_hidden_layers=1,
                         num_attention_heads=8, num_key_value_heads=8, vocab_size=128)
    # What a Mixtral model built from this config would use: PreTrainedModel resolves the
    # experts implementation at init; a bare block must be told.
    from transformers import MixtralModel
    impl = MixtralModel(MixtralConfig(**{**hcfg.to_dict(), "hidden_size": 64,
                                         "intermediate_size": 64, "num_attention_heads": 4,
                                         "num_key_value_heads": 4})).config._experts_implementation
    hcfg._experts_implementation = impl
    hf = MixtralSparseMoeBlock(hcfg)
    with torch.no_grad():
        hf.gate.weight.normal_(0, d**-0.5)
        hf.experts.gate_up_proj.normal_(0, d**-0.5)
        hf.experts.down_proj.normal_(0, f**-0.5)
    ecfg = MixtralConfig(**hcfg.to_dict())
    ecfg._experts_implementation = "eager"
    hf_eager = MixtralSparseMoeBlock(ecfg)
    hf_eager.load_state_dict(hf.state_dict())

    cfg = ModelConfig(name="bench", d_model=d, n_heads=8, n_kv_heads=8, n_routed_experts=E,
                      top_k=k, moe_ffn_dim=f, router="softmax", norm_topk_prob=True,
                      aux_loss_coef=0.0)
    ours = MoELayer(cfg)
    with torch.no_grad():
        ours.router.weight.copy_(hf.gate.weight)
        gate, up = hf.experts.gate_up_proj.split(f, dim=1)  # [E, F, D] each
        ours.experts.w1.copy_(gate.transpose(1, 2))
        ours.experts.w3.copy_(up.transpose(1, 2))
        ours.experts.w2.copy_(hf.experts.down_proj.transpose(1, 2))  # [E, D, F] -> [E, F, D]
    dense = SwiGLU(d, f)
    with torch.no_grad():
        dense.w1.weight.copy_(gate[0])
        dense.w3.weight.copy_(up[0])
        dense.w2.weight.copy_(hf.experts.down_proj[0])
    mods = [m.to(device, dtype) for m in (ours, hf, hf_eager, dense)]
    return (*mods, impl)


def step_fn(module: torch.nn.Module, x: torch.Tensor, dy: torch.Tensor) -> Callable[[], None]:
    def step() -> None:
        for p in module.parameters():
            p.grad = None
        xi = x.detach().requires_grad_()
        out = module(xi)
        out.backward(dy)
    return step


def run_shape(name: str, args: argparse.Namespace, device: torch.device, dtype: torch.dtype) -> list[dict]:
    d, f, E, k = SHAPES[name]
    T = args.tokens
    ours, hf, hf_eager, dense, impl = build(d, f, E, k, device, dtype, seed=0)
    x = torch.randn(1, T, d, device=device, dtype=dtype)
    dy = torch.randn(1, T, d, device=device, dtype=dtype)
    # Same weights -> same outputs (up to summation order): proves the comparison is fair.
    with torch.no_grad():
        diff = (ours(x) - hf(x)).abs().max().item()
    xd = torch.randn(T * k, d, device=device, dtype=dtype)
    dyd = torch.randn(T * k, d, device=device, dtype=dtype)
    contenders = {"ours": step_fn(ours, x, dy), f"hf-{impl}": step_fn(hf, x, dy),
                  "dense-swiglu": step_fn(dense, xd, dyd)}
    if impl != "eager" and not args.skip_eager:
        contenders["hf-eager"] = step_fn(hf_eager, x, dy)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    # "cpu" clock: this process's CPU seconds. With --threads 1 it counts the work done and not
    # the time spent preempted, so it stays meaningful on a shared, oversubscribed machine.
    clock = time.process_time if args.clock == "cpu" else time.perf_counter
    for fn in contenders.values():  # warm-up (allocator, oneDNN/Triton compilation)
        for _ in range(args.warmup):
            fn()
    times: dict[str, list[float]] = {n: [] for n in contenders}
    for _ in range(args.repeats):
        for n, fn in contenders.items():  # round-robin: noise hits every contender alike
            sync()
            t0 = clock()
            fn()
            sync()
            times[n].append(clock() - t0)
    med = {n: statistics.median(v) for n, v in times.items()}
    rows = []
    sha, dev = git_sha(), device_name(device)
    for n, t in med.items():
        rows.append(dict(bench="moe_layer", shape=name, d=d, f=f, E=E, k=k, T=T, method=n,
                         seconds=t, ours_speedup=t / med["ours"],
                         ours_over_dense=med["ours"] / med["dense-swiglu"], max_abs_diff_vs_hf=diff,
                         dtype=str(dtype), device=dev, git=sha, repeats=args.repeats,
                         threads=torch.get_num_threads(), clock=args.clock))
    print(f"\n{name}: d={d} f={f} E={E} k={k} T={T} ({dev}, {args.clock} clock; "
          f"ours vs hf max|diff|={diff:.2e})")
    print(f"{'method':18s} {'median s':>10s} {'ours faster by':>15s}")
    for n, t in med.items():
        print(f"{n:18s} {t:10.4f} {t / med['ours']:14.2f}x")
    print(f"ours / dense = {med['ours'] / med['dense-swiglu']:.3f}  (target <= 1.3); "
          f"hf-{impl} / ours = {med[f'hf-{impl}'] / med['ours']:.3f}  (target >= 1.8)")
    return rows


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    shapes = list(dict.fromkeys(r["shape"] for r in rows))
    fig, axes = plt.subplots(1, len(shapes), figsize=(5 * len(shapes), 3.5), squeeze=False)
    for ax, s in zip(axes[0], shapes, strict=True):
        rs = [r for r in rows if r["shape"] == s]
        ax.bar([r["method"] for r in rs], [r["seconds"] for r in rs])
        ax.set_title(f"{s} (E={rs[0]['E']}, k={rs[0]['k']}, f={rs[0]['f']})")
        ax.set_ylabel("fwd+bwd median seconds")
        ax.tick_params(axis="x", labelsize=7)
    fig.suptitle(f"MoE layer, {rows[0]['device']}")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    p.add_argument("--tokens", type=int, default=2048)
    p.add_argument("--dtype", default=None, help="default float32 on CPU, bfloat16 on GPU")
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--clock", default="wall", choices=["wall", "cpu"],
                   help="wall time, or process CPU time (CPU only; use with --threads 1)")
    p.add_argument("--skip-eager", action="store_true", help="leave out the hf eager loop")
    p.add_argument("--threads", type=int, default=None,
                   help="torch CPU threads (default: torch's choice; 1 is steadier on a busy machine)")
    add_output_args(p, "moe_layer")
    return p


def main(argv: list[str] | None = None) -> int:
    p = parser()
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if args.clock == "cpu" and device.type == "cuda":
        p.error("--clock cpu measures host CPU time; use the default wall clock on a GPU")
    dtype = getattr(torch, args.dtype or ("bfloat16" if device.type == "cuda" else "float32"))
    rows = []
    for s in args.shapes:
        rows += run_shape(s, args, device, dtype)
    out = output_dir(args)
    with open(out / "bench_moe_layer.jsonl", "a") as fh:
        for r in rows:
            fh.write(json.dumps(r) + "\n")
    plot(rows, out / "bench_moe_layer.png")
    print_written(out / "bench_moe_layer.jsonl", out / "bench_moe_layer.png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
