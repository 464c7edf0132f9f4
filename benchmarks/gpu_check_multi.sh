#!/usr/bin/env bash
# Pipeline x expert parallelism on several GPUs with NCCL against one process (issue 22,
# `make gpu-check-multi`). 4 or more GPUs: PP=2 x EP=2 on 4 processes; 2 or 3 GPUs: PP=2 on 2.
# The tiny model trains STEPS steps (1F1B, 4 micro-batches, flat all-to-all) once on one GPU
# and once in that layout, in fp32 and in bf16; benchmarks/gpu_check_losses.py compares the
# per-step losses:
#   fp32  rel 1e-3: the sharp check. On the CPU (gloo) the same layouts agree with one
#         process to rel 2e-4 over 10 steps (tests/test_trainer_pipeline.py); the grouped GEMM
#         runs fp32 inputs exactly (no tf32) unless torch allows tf32 matmuls.
#   bf16  rel 2e-2: bf16 stage boundaries and bf16 GEMMs of different shapes round
#         differently and Adam carries the differences on; a first bound, to be tightened
#         from the first run's numbers (its table is in compare-bf16.log).
# A rank that waits longer than 90 s on a collective or P2P fails the run (a deadlock shows as
# an error, not a hang). Budget: none by default (GPU_CHECK_BUDGET_S, benchmarks/gpu_env.sh);
# the step limits add up to 2260 s with 4 GPUs and 2120 s with 2 (the fb case in the
# pipeline needs 4); the runs themselves take a fraction of that.
#
#   benchmarks/gpu_check_multi.sh [OUT_DIR]    (default runs/bench/gpu-multi-<date>, ignored)
#   STEPS=20 PY=python benchmarks/gpu_check_multi.sh /tmp/multi
#
# OUT_DIR gets: env.txt, summary.txt, <step>.log, and one run folder per (layout, dtype) with
# its metrics.jsonl. Exit status: 0 when every run and comparison passed, 1 otherwise, 2 when
# fewer than 2 GPUs are visible.
set -u -o pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
OUT="${1:-$ROOT/runs/bench/gpu-multi-$(date +%Y%m%d-%H%M%S)}"
STEPS="${STEPS:-20}"
# shellcheck source=benchmarks/gpu_env.sh
source "$ROOT/benchmarks/gpu_env.sh"

{
  "$PY" -c 'import torch; print("torch", torch.__version__, "cuda", torch.version.cuda, "hip", torch.version.hip, "nccl", torch.cuda.nccl.version() if torch.cuda.is_available() else None); print("gpus", [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())] if torch.cuda.is_available() else 0)'
  nvidia-smi topo -m 2>/dev/null || rocm-smi 2>/dev/null || true
} >> "$OUT/env.txt" 2>&1

# What the runs import (the elastic step plans with tuner, which needs optuna), before any run.
require_modules torch numpy tokenizers safetensors tqdm optuna model piper_kernels pipeline \
  comm trainer tuner

n_gpu="$("$PY" -c 'import torch; print(torch.cuda.device_count() if torch.cuda.is_available() else 0)' 2>/dev/null || echo 0)"
if [ "${n_gpu:-0}" -lt 2 ]; then
  echo "gpu_check_multi: needs >= 2 GPUs, $PY sees ${n_gpu:-0} (see $OUT/env.txt)" | tee "$OUT/summary.txt" >&2
  exit 2
fi
if [ "$n_gpu" -ge 4 ]; then
  NPROC=4; LAYOUT=(--parallel.pp=2 --parallel.ep=2); NAME=pp2-ep2
else
  NPROC=2; LAYOUT=(--parallel.pp=2 --parallel.ep=1); NAME=pp2
fi
echo "gpu_check_multi: $n_gpu GPUs visible; layout $NAME on $NPROC processes (NCCL), $STEPS steps" | tee "$OUT/summary.txt"


COMMON=(--config configs/tiny.toml --train.steps="$STEPS" --train.eval_every=0 --train.plot=false
        --train.timeout_s=90 --optim.warmup_steps=5 --comm.alltoall=flat
        --parallel.schedule=1f1b --parallel.microbatches=4)
for dtype in fp32 bf16; do
  if [ "$dtype" = fp32 ]; then rtol=1e-3; else rtol=2e-2; fi
  step "ref-$dtype" 70 "$PY" train.py "${COMMON[@]}" --parallel.pp=1 --parallel.ep=1 \
    --train.dtype="$dtype" --train.out_dir="$OUT/ref-$dtype"
  step "$NAME-$dtype" 120 "$PY" -m torch.distributed.run --standalone --nproc-per-node "$NPROC" \
    train.py "${COMMON[@]}" "${LAYOUT[@]}" --train.dtype="$dtype" --train.out_dir="$OUT/$NAME-$dtype"
  step "compare-$dtype" 20 "$PY" benchmarks/gpu_check_losses.py compare "$OUT/ref-$dtype" \
    "$OUT/$NAME-$dtype" --rtol "$rtol"
  # ZeRO-3 (FSDP2 over NCCL, trainer/distributed/zero3.py): pure data parallel over the GPUs, parameters
  # sharded and gathered per layer, against the one-GPU run
  step "zero3-$dtype" 120 "$PY" -m torch.distributed.run --standalone --nproc-per-node "$NPROC" \
    train.py "${COMMON[@]}" --parallel.pp=1 --parallel.ep=1 --parallel.zero=3 \
    --train.dtype="$dtype" --train.out_dir="$OUT/zero3-$dtype"
  step "compare-zero3-$dtype" 20 "$PY" benchmarks/gpu_check_losses.py compare \
    "$OUT/ref-$dtype" "$OUT/zero3-$dtype" --rtol "$rtol"
  # Tensor parallel (trainer/distributed/tensor_parallel.py) over 2 GPUs: attention heads and
  # the experts' FFN split, their all-reduces on NCCL, against the one-GPU run
  step "tp2-$dtype" 120 "$PY" -m torch.distributed.run --standalone --nproc-per-node 2 \
    train.py "${COMMON[@]}" --parallel.pp=1 --parallel.ep=1 --parallel.tp=2 \
    --train.dtype="$dtype" --train.out_dir="$OUT/tp2-$dtype"
  step "compare-tp2-$dtype" 20 "$PY" benchmarks/gpu_check_losses.py compare \
    "$OUT/ref-$dtype" "$OUT/tp2-$dtype" --rtol "$rtol"
done

# The expert all-to-all overlapped (chunk pipeline on NCCL's stream, HALO on a communication
# stream) and deduplicated (issue 26), EP=2 over two declared nodes, fp32: the same losses as
# the plain flat exchange (summation order only; 1e-4 over 20 steps).
EP2=(--config configs/tiny.toml --train.steps="$STEPS" --train.eval_every=0 --train.plot=false
     --train.timeout_s=90 --optim.warmup_steps=5 --parallel.pp=1 --parallel.ep=2
     --model.top_k=4 --train.dtype=fp32 --comm.topology=configs/topologies/2x1-local.toml)
# fb (micro-batches paired on a baton: one's forward beside the other's backward exchanges,
# their starts in one order on both ranks) runs 2 micro-batches of gradient accumulation:
# against the plain run's one, the summation order only, inside the same 1e-4.
for arm in flat/none flat/layer halo/layer dedup/none dedup/layer flat/fb; do
  a2a="${arm%/*}"; ov="${arm#*/}"
  mb=1; if [ "$ov" = fb ]; then mb=2; fi
  step "ep2-$a2a-$ov" 90 "$PY" -m torch.distributed.run --standalone --nproc-per-node 2 \
    train.py "${EP2[@]}" --comm.alltoall="$a2a" --comm.a2a_overlap="$ov" --comm.a2a_chunks=2 \
    --parallel.microbatches="$mb" --train.out_dir="$OUT/ep2-$a2a-$ov"
  if [ "$arm" != flat/none ]; then
    step "compare-ep2-$a2a-$ov" 20 "$PY" benchmarks/gpu_check_losses.py compare \
      "$OUT/ep2-flat-none" "$OUT/ep2-$a2a-$ov" --rtol 1e-4
  fi
done

# auto across the declared nodes (issue 26): its rules, the calibration of the per-call
# flat / HALO model on NCCL, then its trial over the first steps (trainer/a2a_trial.py: 13
# steps switching among dedup / auto / flat x fb / none, on the fb schedule; the decision's
# all_reduce on a CUDA tensor), 2 micro-batches: the plain run's losses within the same 1e-4
step "ep2-auto-auto" 240 "$PY" -m torch.distributed.run --standalone --nproc-per-node 2 \
  train.py "${EP2[@]}" --comm.alltoall=auto --comm.a2a_overlap=auto --comm.a2a_chunks=auto \
  --parallel.microbatches=2 --train.out_dir="$OUT/ep2-auto-auto"
step "compare-ep2-auto-auto" 20 "$PY" benchmarks/gpu_check_losses.py compare \
  "$OUT/ep2-flat-none" "$OUT/ep2-auto-auto" --rtol 1e-4

# fb in the pipeline (pipeline.build_fb: 1F1B's steady-state B / F pairs run on the baton,
# the EP exchanges of both on NCCL in one order): PP=2 x EP=2 against the one-GPU run
if [ "$n_gpu" -ge 4 ]; then
  step "$NAME-fb-fp32" 120 "$PY" -m torch.distributed.run --standalone --nproc-per-node "$NPROC" \
    train.py "${COMMON[@]}" "${LAYOUT[@]}" --train.dtype=fp32 --comm.a2a_overlap=fb \
    --train.out_dir="$OUT/$NAME-fb-fp32"
  step "compare-$NAME-fb-fp32" 20 "$PY" benchmarks/gpu_check_losses.py compare "$OUT/ref-fp32" \
    "$OUT/$NAME-fb-fp32" --rtol 1e-3
fi

# Elastic re-plan (issue 30, trainer/elastic.py): one GPU writes the checkpoint of step
# STEPS/2, then NPROC processes resume it with --train.replan=auto: rank 0 plans, the layout
# goes to every rank through NCCL (broadcast_object_list on cuda:LOCAL_RANK), and the losses
# must equal the uninterrupted one-GPU run (fp32, the rtol of the layouts above).
step "elastic-first" 70 "$PY" train.py "${COMMON[@]}" --parallel.pp=1 --parallel.ep=1 \
  --train.dtype=fp32 --train.stop_after=$((STEPS / 2)) \
  --train.out_dir="$OUT/elastic"
step "elastic-replan" 150 "$PY" -m torch.distributed.run --standalone --nproc-per-node "$NPROC" \
  train.py "${COMMON[@]}" --parallel.pp=1 --parallel.ep=1 \
  --train.dtype=fp32 --train.resume=auto --train.replan=auto --train.platform=h200-node \
  --train.out_dir="$OUT/elastic"
step "compare-elastic" 20 "$PY" benchmarks/gpu_check_losses.py compare "$OUT/ref-fp32" \
  "$OUT/elastic" --rtol 1e-3

echo "results in $OUT (status $status)"
exit $status
