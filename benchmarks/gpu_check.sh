#!/usr/bin/env bash
# One command for the scarce GPU time (issues 3 and 22, `make gpu-check`): the GPU test tier
# (compiled Triton kernels, fp16 + bf16), a short bf16 training of the tiny model on one GPU
# (EP=1, PP=1: its loss curve and tokens/s), autotuning of one preset, the kernel benchmarks and
# document-masked attention, every result in one folder. Budget: under 11 minutes on one GPU
# (the step limits add up to 620 s); each step has its own time limit so one hang cannot eat the rest, and a failed step
# does not stop the later ones. Several GPUs: benchmarks/gpu_check_multi.sh (PP x EP, NCCL).
#
#   benchmarks/gpu_check.sh [OUT_DIR]     (default runs/bench/gpu-<date>, ignored by git)
#   PRESET=qwen3-30b-a3b PY=python TRAIN_STEPS=30 benchmarks/gpu_check.sh /tmp/run1
#
# OUT_DIR gets: env.txt, summary.txt (one line per step with its exit status and seconds),
# <step>.log for every step, gpu-tests.xml (JUnit), train-bf16/ (the run's metrics.jsonl),
# autotune-cache.json, bench_*.jsonl/.png.
# Exit status: 0 when every step passed, 1 otherwise, 2 when no GPU is visible.
set -u -o pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
OUT="${1:-$ROOT/runs/bench/gpu-$(date +%Y%m%d-%H%M%S)}"
PRESET="${PRESET:-mixtral-8x7b}"
TRAIN_STEPS="${TRAIN_STEPS:-30}"
# shellcheck source=benchmarks/gpu_env.sh
source "$ROOT/benchmarks/gpu_env.sh"
# Winners land next to the other results and the benchmarks below launch with them.
export PIPER_KERNELS_CACHE="$OUT/autotune-cache.json"

{
  "$PY" -c 'import torch, triton; print("torch", torch.__version__, "cuda", torch.version.cuda, "hip", torch.version.hip); print("triton", triton.__version__); print("gpu", torch.cuda.get_device_name(0) if torch.cuda.is_available() else None)'
  nvidia-smi 2>/dev/null || rocm-smi 2>/dev/null || true
} >> "$OUT/env.txt" 2>&1

if ! "$PY" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)' 2>/dev/null; then
  echo "gpu_check: no CUDA/ROCm GPU visible to $PY (see $OUT/env.txt)" | tee "$OUT/summary.txt" >&2
  exit 2
fi


# 1. Kernel tests compiled on the GPU (fp16, bf16; larger shapes than the interpreter's), and
#    the pipeline runtime's CUDA-event spans. Most of the time is Triton compiling ~20 kernel
#    variants.
step gpu-tests 130 "$PY" -m pytest -q -p no:cacheprovider -m gpu tests/test_kernels_triton.py \
  tests/test_gpu_path.py --junitxml="$OUT/gpu-tests.xml" --durations=10
# 2. The trainer end to end on one GPU: the tiny model, bf16 autocast, EP=1, PP=1, default
#    corpus. The first steps compile the grouped-GEMM kernels; then its loss curve and
#    tokens/s (median over the second half), failing on a non-finite loss or one that does
#    not fall by 5 % from the first to the last steps.
step train-bf16 70 "$PY" train.py --config configs/tiny.toml --parallel.pp=1 --parallel.ep=1 \
  --train.steps="$TRAIN_STEPS" --train.dtype=bf16 --train.out_dir="$OUT/train-bf16" \
  --train.eval_every=0 --train.plot=false --train.timeout_s=60 --optim.warmup_steps=5 \
  --comm.alltoall=flat
SHOW=40 step train-curve 10 "$PY" benchmarks/gpu_check_losses.py curve "$OUT/train-bf16"
# 2b. The same with --train.compile=true (trainer/compile.py): the compiled blocks' curve;
#     metrics.jsonl's "recompilations" must stay 0 after the warm-up.
step train-compiled 90 "$PY" train.py --config configs/tiny.toml --parallel.pp=1 --parallel.ep=1 \
  --train.steps="$TRAIN_STEPS" --train.dtype=bf16 --train.compile=true \
  --train.out_dir="$OUT/train-compiled" --train.eval_every=0 --train.plot=false \
  --train.timeout_s=60 --optim.warmup_steps=5 --comm.alltoall=flat
SHOW=40 step train-compiled-curve 10 "$PY" benchmarks/gpu_check_losses.py curve \
  "$OUT/train-compiled"
# 3. Autotune one preset (6 GEMM problems x 4 candidates, ~3 s of compiling each); every
#    winner is written to $PIPER_KERNELS_CACHE as soon as it is known.
step autotune 105 "$PY" -m model.autotune --model "$PRESET" --tokens 4096 --max-configs 4
# 4. Grouped GEMM TFLOPS vs torch._grouped_mm, a per-expert loop and a dense GEMM.
step bench-grouped-gemm 85 "$PY" benchmarks/bench_grouped_gemm.py --out "$OUT" --repeats 10
# 5. MoE layer fwd+bwd vs transformers' MixtralSparseMoeBlock and a dense SwiGLU (bf16).
step bench-moe-layer 70 "$PY" benchmarks/bench_moe_layer.py --out "$OUT" --repeats 10 \
  --warmup 3 --skip-eager
# 6. Document-masked attention: the compiled flex block mask against the dense mask (outputs and
#    gradients), then peak memory and time of dense / varlen / flex at S = 4096.
step doc-attention-tests 90 "$PY" -m pytest -q -p no:cacheprovider -m gpu \
  tests/test_doc_attention.py
step bench-doc-attention 60 "$PY" benchmarks/bench_doc_attention.py --out "$OUT" --seq 4096 \
  --batch 4 --heads 16 --head-dim 128

echo "results in $OUT (status $status)"
exit $status
