#!/usr/bin/env bash
# One command for the scarce GPU time (issues 3 and 22, `make gpu-check`): the GPU test tier
# (compiled Triton kernels, fp16 + bf16), a short bf16 training of the tiny model on one GPU
# (EP=1, PP=1: its loss curve and tokens/s), the same with bf16 working weights, the kernel
# benchmarks, document-masked attention, a torch.compile'd training and autotuning of one
# preset, every result in one folder. Several GPUs: benchmarks/gpu_check_multi.sh (PP x EP,
# TP, ZeRO-3, the all-to-all overlap on NCCL).
#
# Budget: GPU_CHECK_BUDGET_S (default 540 s, one 10-minute device call with room for the
# machine's own start and the transfers; 0 = none) bounds the whole check; the steps run most
# important first, each with its own time limit (one hang cannot eat the rest, a failed step
# does not stop the later ones), and the steps the budget leaves no time for are listed as
# skipped (benchmarks/gpu_env.sh). The step limits add up to 800 s: on a GPU the steps end far
# below them, else the budget drops the last ones (autotune, the attention benchmark).
#
#   benchmarks/gpu_check.sh [OUT_DIR]     (default runs/bench/gpu-<date>, ignored by git)
#   PRESET=qwen3-30b-a3b PY=python TRAIN_STEPS=30 benchmarks/gpu_check.sh /tmp/run1
#   GPU_CHECK_ARCHIVE=$OUT/gpu-check.tar.gz benchmarks/gpu_check.sh /tmp/gc   (one archive +
#     summary.txt: what a lent machine brings back; docs/benchmarks.md, "The GPU checks")
#
# OUT_DIR gets: env.txt, summary.txt (one line per step with its exit status and seconds),
# <step>.log for every step, gpu-tests.xml (JUnit), train-bf16/ and train-bf16-weights/ (the
# runs' metrics.jsonl), autotune-cache.json, bench_*.jsonl/.png.
# Exit status: 0 when every step passed, 1 otherwise, 2 when no GPU is visible, 3 when the
# Python lacks a module the steps import, 64 on a bad setting.
set -u -o pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
OUT="${1:-$ROOT/runs/bench/gpu-$(date +%Y%m%d-%H%M%S)}"
PRESET="${PRESET:-mixtral-8x7b}"
TRAIN_STEPS="${TRAIN_STEPS:-30}"
GPU_CHECK_BUDGET_S="${GPU_CHECK_BUDGET_S:-540}"
# shellcheck source=benchmarks/gpu_env.sh
source "$ROOT/benchmarks/gpu_env.sh"
# Winners land next to the other results and the benchmarks below launch with them.
export PIPER_KERNELS_CACHE="$OUT/autotune-cache.json"

{
  "$PY" -c 'import torch, triton; print("torch", torch.__version__, "cuda", torch.version.cuda, "hip", torch.version.hip); print("triton", triton.__version__); print("gpu", torch.cuda.get_device_name(0) if torch.cuda.is_available() else None)'
  nvidia-smi 2>/dev/null || rocm-smi 2>/dev/null || true
} >> "$OUT/env.txt" 2>&1

# What the steps import, checked before any of them (a lent machine's image has no registry).
require_modules torch triton numpy pytest hypothesis transformers matplotlib tokenizers \
  safetensors huggingface_hub tqdm model piper_kernels pipeline comm trainer

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
TRAIN=(train.py --config configs/tiny.toml --parallel.pp=1 --parallel.ep=1
       --train.steps="$TRAIN_STEPS" --train.dtype=bf16 --train.eval_every=0 --train.plot=false
       --train.timeout_s=60 --optim.warmup_steps=5 --comm.alltoall=flat)
step train-bf16 70 "$PY" "${TRAIN[@]}" --train.out_dir="$OUT/train-bf16"
SHOW=40 step train-curve 10 "$PY" benchmarks/gpu_check_losses.py curve "$OUT/train-bf16"
# 2a. bf16 working weights (--train.param_dtype=bf16, trainer/distributed/precision.py): the
#     forward reads bf16 parameters, the fp32 masters and moments stay in the optimizer.
step train-bf16-weights 70 "$PY" "${TRAIN[@]}" --train.param_dtype=bf16 \
  --train.out_dir="$OUT/train-bf16-weights"
SHOW=40 step train-bf16-weights-curve 10 "$PY" benchmarks/gpu_check_losses.py curve \
  "$OUT/train-bf16-weights"
# 3. Document-masked attention: the compiled flex block mask against the dense mask (outputs and
#    gradients).
step doc-attention-tests 90 "$PY" -m pytest -q -p no:cacheprovider -m gpu \
  tests/test_doc_attention.py
# 4. Grouped GEMM TFLOPS vs torch._grouped_mm, a per-expert loop and a dense GEMM.
step bench-grouped-gemm 85 "$PY" benchmarks/bench_grouped_gemm.py --out "$OUT" --repeats 10
# 5. MoE layer fwd+bwd vs transformers' MixtralSparseMoeBlock and a dense SwiGLU (bf16).
step bench-moe-layer 70 "$PY" benchmarks/bench_moe_layer.py --out "$OUT" --repeats 10 \
  --warmup 3 --skip-eager
# 6. The trainer with --train.compile=true (trainer/compile.py): the compiled blocks' curve;
#    metrics.jsonl's "recompilations" must stay 0 after the warm-up.
step train-compiled 90 "$PY" "${TRAIN[@]}" --train.compile=true \
  --train.out_dir="$OUT/train-compiled"
SHOW=40 step train-compiled-curve 10 "$PY" benchmarks/gpu_check_losses.py curve \
  "$OUT/train-compiled"
# 7. Autotune one preset (6 GEMM problems x 4 candidates, ~3 s of compiling each); every
#    winner is written to $PIPER_KERNELS_CACHE as soon as it is known.
step autotune 105 "$PY" -m model.autotune --model "$PRESET" --tokens 4096 --max-configs 4
# 8. Peak memory and time of dense / varlen / flex document-masked attention at S = 4096.
step bench-doc-attention 60 "$PY" benchmarks/bench_doc_attention.py --out "$OUT" --seq 4096 \
  --batch 4 --heads 16 --head-dim 128

echo "results in $OUT (status $status)"
exit $status
