"""Predict published MoE training runs with `python -m tuner estimate` and compare (issue 33 item 7).

The runs are benchmarks/data/published_runs.toml (sources and what each one measures:
docs/reference.md section 5). For every run the layout is turned into `tuner estimate` flags,
the estimate is run as a subprocess with `--json` (the last stdout line is its JSON object,
the contract of `tuner.single.summary`), and the prediction is compared with the measured
figure in the source's own terms:

- tokens/s/GPU where the source prints it, or a step time (then tokens/s/GPU = global batch x
  sequence / step time / GPUs, exact arithmetic on the printed numbers);
- else model TFLOP/s/GPU, only where the source uses Megatron's formula and the estimate
  reports `megatron_tflops_per_gpu` (tuner.flops.megatron_flops_per_token, the same
  structure): the long-context rows, which print nothing else.

error = predicted / measured - 1 (positive: the planner is optimistic). Summary: median
|error|, the share within 15 % and 25 %, and for every `rank_group` (one model on one machine
type at several layouts, from one source) whether the predicted order equals the measured one
(pairwise order agreement over pairs whose measured values differ, and Spearman's rho).

Flags per run: `--vpp` = the run's VP, `--zero` 3 with FSDP, 1 with Megatron's distributed
optimizer, 0 without either; `--dispatch` flat for NCCL all-to-all, dedup for DeepEP / HybridEP;
`--recompute` moe where the module list has Megatron's `moe`, selective for any other list;
`--precision` fp8 for FP8 / MXFP8 GEMMs; `--zero3-gather` where the run states `zero3_gather`
(FSDP2 under torch.distributed.pipelining: "step") and `--zero3-runs` its `zero3_runs` (the
table's gradient-accumulation count of whole schedule runs); `--host-floor-ms` by the run's
`framework` (HOST_FLOOR_MS: Megatron-Core's measured host floor per MoE layer and
micro-batch; its forward share, `forward_host_floor_ms`, with `--host-floor-scope forward`),
or by the run's own `host_floor` (a step of its recipe measured outside the file,
`own_host_floor_ms`). A run marked `floor_layout` (its layout is the one its floor was
measured on) is predicted and ranked but left out of the error summary. Megatron-Core rows with the all-to-all overlap
(fb) get `--fb-pairing layer` (its combined 1F1B interleaves the paired micro-batches layer by
layer). Where the source leaves a field unknown the run's `assumed` value is used, else this script's default
(DEFAULTS); each row lists the fields it assumed. Where this checkout's estimate CLI offers them,
`--precision-policy megatron --zero-sharding flat` are added (Megatron-Core's state bytes and its
flat distributed-optimizer shards: every source here is Megatron-Core or FSDP2).
Runs without a preset or without a platform file are listed as skipped with the reason.

    .venv/bin/python benchmarks/bench_tuner_published.py              # all runs
    .venv/bin/python benchmarks/bench_tuner_published.py --only zoo-  # ids starting with zoo-
    .venv/bin/python benchmarks/bench_tuner_published.py --fp8-peak-factor 2.0  # FP8 runs on a
        platform file without an FP8 rate (`fp8_peak_tflops`; dgx-h100 states one): FP8 / bf16
        dense peak assumed 2 (an assumption, listed)
    .venv/bin/python benchmarks/bench_tuner_published.py --record     # the tracked record

Results: tuner_published.jsonl (one row per run, appended, with commit and time) and
tuner_published.md (this run's table) in runs/bench/tuner_published/ (ignored by git) or
`--out DIR`; `--record` writes them to the tracked records. No timing of this machine is involved (the estimate is analytic), so no lock.
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import statistics
import subprocess
import sys
import time
import tomllib
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from _common import ROOT, add_output_args, git_sha, output_dir, print_written

DATA = Path(__file__).resolve().parent / "data" / "published_runs.toml"
UNKNOWN = "unknown"
# What this script assumes for a field that is unknown and has no `assumed` value in the run.
DEFAULTS: dict[str, Any] = {"etp": 1, "a2a_overlap": "none", "recompute": "none",
                            "distributed_optimizer": True, "dispatcher": "alltoall",
                            "fsdp_degree": None}
DISPATCH = {"alltoall": "flat", "deepep": "dedup", "hybridep": "dedup"}
A2A = {"none": "none", "fb": "fb", "layer": "layer"}
PRECISION = {"bf16": "bf16", "fp8": "fp8"}
ZERO3_GATHER = ("microbatch", "step")  # `zero3_gather`: tuner estimate --zero3-gather
OPTIONAL_FLAGS = (("--precision-policy", "megatron"), ("--zero-sharding", "flat"))
# The host floor of one MoE layer's forward + backward per micro-batch (`tuner estimate
# --host-floor-ms`, Assumptions.host_floor) by the run's `framework`: Megatron-Core's dropless
# MoE syncs the host on every dispatch, so a layer whose device work is short waits for the
# host to launch it. Measured, outside the compared rows: Megatron-Bridge 25.11's Qwen3-30B-A3B
# on 8 DGX B200 at MBS 1 (GBS 512, EP 8, 64 micro-batches x 48 layers per step), 9299
# tokens/s/GPU = 28.19 s per step = 9.18 ms per layer and micro-batch, where four times the
# tokens per micro-batch (MBS 4, 26.04.01) take 12.6 ms: at MBS 1 the step is bound by
# something that does not grow with the tokens (26.02 prints MBS 1 at 9691: 8.81 ms).
# docs/reference.md section 5, "host floor". NeMo AutoModel (FSDP2): no figure, not priced.
HOST_FLOOR_MS: dict[str, float] = {"megatron-core": 9.18, "automodel": 0.0}
# That row's 9.18 ms is a whole layer (forward + backward). The host syncs in the forward's
# dispatch only; the backward reuses its splits and runs at device speed, so the floor is
# priced on the forward (`--host-floor-scope forward`): layer = max(host, forward device) +
# backward device. The host's share follows from the same row: 9.18 ms minus the model's own
# backward device time there (`forward_host_floor_ms`: ~1.3 ms on dgx-b200 at MBS 1, 4096
# tokens, FP8, recompute none). The MBS 4 row of that table (compared) then checks it.
FLOOR_SOURCE_FLAGS = ["--model", "qwen3-30b-a3b", "--platform", "dgx-b200", "--gpus", "8",
                      "--seq", "4096", "--global-batch", "512", "--mbs", "1", "--ep", "8",
                      "--precision", "fp8", "--precision-policy", "megatron",
                      "--zero-sharding", "flat", "--recompute", "none"]
FLOOR_SOURCE_LAYERS_X_MICROBATCHES = 48 * 64  # 48 layers, GBS 512 / DP 8 = 64 micro-batches

__all__ = ["estimate_flags", "load_runs", "measured", "order_agreement", "predicted", "spearman",
           "summarise"]


def load_runs(path: Path = DATA) -> list[dict[str, Any]]:
    """The `[[run]]` tables of the published-runs file, with their ids checked unique."""
    runs = tomllib.loads(Path(path).read_text())["run"]
    ids = [r["id"] for r in runs]
    dup = sorted({i for i in ids if ids.count(i) > 1})
    if dup:
        raise ValueError(f"{path}: duplicate run ids {dup}")
    return runs


def _field(run: dict[str, Any], key: str, assumed: list[str]) -> Any:
    """The run's value of `key`; if unknown, its `assumed` value or DEFAULTS[key] (noted)."""
    v = run.get(key, UNKNOWN)
    if v != UNKNOWN:
        return v
    a = run.get("assumed", {})
    if key in a:
        assumed.append(f"{key}={a[key]}")
        return a[key]
    if key in DEFAULTS:
        assumed.append(f"{key}={DEFAULTS[key]} (bench default)")
        return DEFAULTS[key]
    raise ValueError(f"run {run['id']}: {key} is unknown and nothing is assumed for it")


def _choice(run: dict[str, Any], key: str, value: Any, table: dict[str, str]) -> str:
    if value not in table:
        raise ValueError(f"run {run['id']}: {key}={value!r}; valid: {', '.join(table)}")
    return table[value]


def estimate_flags(run: dict[str, Any], runs: dict[str, dict[str, Any]] | None = None
                   ) -> tuple[list[str], list[str]]:
    """`tuner estimate` flags for a run and the fields it had to assume (module docstring).
    `runs`: the file's runs by id, for a run whose `host_floor` names the layout it was
    measured on (default: the published-runs file's)."""
    flags, assumed = _layout_flags(run)
    framework = run.get("framework", UNKNOWN)
    if framework not in HOST_FLOOR_MS:
        raise ValueError(f"run {run['id']}: framework={framework!r}; valid: "
                         f"{', '.join(HOST_FLOOR_MS)}")
    own = run.get("host_floor")
    if own is not None:
        floor = own_host_floor_ms(run, runs if runs is not None else
                                  {r["id"]: r for r in load_runs()})
    elif HOST_FLOOR_MS[framework]:
        floor = forward_host_floor_ms(HOST_FLOOR_MS[framework])
    else:
        floor = 0.0
    if floor:
        flags += ["--host-floor-ms", f"{floor:.4g}", "--host-floor-scope", "forward"]
    if framework == "megatron-core" and _flag_value(flags, "--a2a-overlap") == "fb":
        # Megatron-Core's combined 1F1B pairs two micro-batches layer by layer: one layer's
        # activations more than the plain schedule (Assumptions.fb_pairing)
        flags += ["--fb-pairing", "layer"]
    return flags, assumed


def own_host_floor_ms(run: dict[str, Any], runs: dict[str, dict[str, Any]]) -> float:
    """The forward host floor (ms) of a run with its own `host_floor` = {step_time_s, layout,
    source}: the measured step of the run `layout` (a pipeline of one stage) per MoE layer
    and micro-batch of that layout (its global batch / (micro-batch x data-parallel ranks)
    micro-batches), its forward share by `forward_host_floor_ms` on that layout's flags."""
    from model import presets

    hf = run["host_floor"]
    if not isinstance(hf, dict) or set(hf) != {"step_time_s", "layout", "source"}:
        raise ValueError(f"run {run['id']}: host_floor={hf!r} must be a table of step_time_s, "
                         "layout and source")
    step = hf["step_time_s"]
    if isinstance(step, bool) or not isinstance(step, int | float) or step <= 0:
        raise ValueError(f"run {run['id']}: host_floor.step_time_s={step!r} must be seconds > 0")
    src = runs.get(hf["layout"])
    if src is None:
        raise ValueError(f"run {run['id']}: host_floor.layout={hf['layout']!r} is no run id "
                         "of the file")
    if src["pp"] != 1 or src["vp"] != 1:
        raise ValueError(f"run {run['id']}: host_floor.layout {src['id']} has pp={src['pp']}, "
                         f"vp={src['vp']}; the floor is derived from a one-stage layout only")
    cfg = presets.get(src["model"])
    moe_layers = sum(cfg.is_moe_layer(i) for i in range(cfg.n_layers))
    dp = src["gpus"] // (src["tp"] * src["cp"])
    microbatches = src["global_batch"] // (src["mbs"] * dp)
    per = moe_layers * microbatches
    return forward_host_floor_ms(1e3 * step / per, tuple(_layout_flags(src)[0]), per)


def _layout_flags(run: dict[str, Any]) -> tuple[list[str], list[str]]:
    """The run's `tuner estimate` flags without its host floor, and the fields assumed."""
    assumed: list[str] = []
    f = functools.partial(_field, run, assumed=assumed)
    fsdp = f("fsdp")
    if fsdp not in (0, "on") and not (isinstance(fsdp, int) and fsdp > 0):
        raise ValueError(f"run {run['id']}: fsdp={fsdp!r}; valid: 0, a degree >= 1, 'on'")
    zero = 3 if fsdp != 0 else (1 if f("distributed_optimizer") is True else 0)
    recompute = str(f("recompute"))
    if recompute.startswith("selective"):
        # Megatron-Core's `moe` module (the whole MoE layer, re-run with its all-to-all) is
        # priced as such; any other module list as our selective (the FFN's gate and up)
        modules = recompute.partition(":")[2].split(",")
        recompute = "moe" if "moe" in modules else "selective"
    if recompute not in ("none", "selective", "moe", "full"):
        raise ValueError(f"run {run['id']}: recompute={recompute!r}; valid: none, "
                         "selective:<modules>, full")
    flags = ["--model", run["model"], "--platform", run["platform"]]
    for flag, key in (("--gpus", "gpus"), ("--seq", "seq"), ("--global-batch", "global_batch"),
                      ("--mbs", "mbs"), ("--tp", "tp"), ("--pp", "pp"), ("--vpp", "vp"),
                      ("--cp", "cp"), ("--ep", "ep"), ("--etp", "etp")):
        v = f(key)
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"run {run['id']}: {key}={v!r} must be an int >= 1")
        flags += [flag, str(v)]
    gather = run.get("zero3_gather")
    if gather is not None:
        if gather not in ZERO3_GATHER or zero != 3:
            raise ValueError(f"run {run['id']}: zero3_gather={gather!r} needs fsdp on and one "
                             f"of {', '.join(ZERO3_GATHER)}")
        flags += ["--zero3-gather", gather]
        runs = run.get("zero3_runs", 1)
        if isinstance(runs, bool) or not isinstance(runs, int) or runs < 1:
            raise ValueError(f"run {run['id']}: zero3_runs={runs!r} must be an int >= 1")
        flags += ["--zero3-runs", str(runs)]
    mtp = run.get("mtp_layers", 0)  # absent: the run has none; "unknown": not priced
    if isinstance(mtp, int) and not isinstance(mtp, bool) and mtp > 0:
        flags += ["--mtp-layers", str(mtp)]
    flags += ["--zero", str(zero), "--recompute", recompute,
              "--dispatch", _choice(run, "dispatcher", f("dispatcher"), DISPATCH),
              "--a2a-overlap", _choice(run, "a2a_overlap", f("a2a_overlap"), A2A),
              "--precision", _choice(run, "precision", f("precision"), PRECISION)]
    return flags, assumed


def skip_reason(run: dict[str, Any]) -> str | None:
    """Why a run cannot be predicted here (no preset, no platform file), or None."""
    if not run.get("preset", True):
        return f"no preset for {run['model']} in model/presets.py"
    if not (ROOT / "configs" / "platforms" / f"{run['platform']}.toml").is_file():
        return f"no platform file configs/platforms/{run['platform']}.toml"
    return None


def measured(run: dict[str, Any]) -> dict[str, Any]:
    """The run's comparable figures: tokens/s/GPU (printed, or from the printed step time) and
    TFLOP/s/GPU with the source's FLOP convention."""
    out: dict[str, Any] = {"tokens": None, "tokens_from": None, "tflops": None,
                           "convention": run.get("flops_convention", UNKNOWN)}
    tok, step = run.get("measured_tokens_per_s_per_gpu"), run.get("measured_step_time_s")
    if isinstance(tok, int | float) and not isinstance(tok, bool):
        out["tokens"], out["tokens_from"] = float(tok), "printed"
    elif isinstance(step, int | float) and not isinstance(step, bool):
        out["tokens"] = run["global_batch"] * run["seq"] / step / run["gpus"]
        out["tokens_from"] = "step time"
    tf = run.get("measured_tflops_per_gpu")
    if isinstance(tf, int | float) and not isinstance(tf, bool):
        out["tflops"] = float(tf)
    return out


def predicted(meas: dict[str, Any], pred: dict[str, Any]) -> tuple[str, float, float] | None:
    """(metric, predicted, measured) of the comparison, or None where nothing compares."""
    if meas["tokens"] is not None:
        return "tokens/s", float(pred["tokens_per_s_per_gpu"]), meas["tokens"]
    if meas["tflops"] is not None and meas["convention"] == "megatron" \
            and "megatron_tflops_per_gpu" in pred:
        return "TFLOP/s (Megatron)", float(pred["megatron_tflops_per_gpu"]), meas["tflops"]
    return None


def order_agreement(meas: list[float], pred: list[float]) -> tuple[int, int]:
    """(pairs ordered alike, pairs compared): pairs whose measured values differ; a predicted
    tie counts as disagreement."""
    agree = total = 0
    for i in range(len(meas)):
        for j in range(i + 1, len(meas)):
            if meas[i] == meas[j]:
                continue
            total += 1
            agree += (meas[i] - meas[j]) * (pred[i] - pred[j]) > 0
    return agree, total


def _ranks(x: list[float]) -> list[float]:
    order = sorted(range(len(x)), key=lambda i: x[i])
    r = [0.0] * len(x)
    i = 0
    while i < len(order):
        j = i
        while j + 1 < len(order) and x[order[j + 1]] == x[order[i]]:
            j += 1
        for k in range(i, j + 1):
            r[order[k]] = (i + j) / 2 + 1  # ties share their mean rank
        i = j + 1
    return r


def spearman(a: list[float], b: list[float]) -> float:
    """Spearman's rank correlation (Pearson's r of the ranks, ties at mean rank); nan when
    either side is constant or has fewer than two values."""
    if len(a) != len(b):
        raise ValueError(f"spearman: lengths {len(a)} and {len(b)} differ")
    if len(a) < 2:
        return math.nan
    ra, rb = _ranks(a), _ranks(b)
    ma, mb = statistics.fmean(ra), statistics.fmean(rb)
    cov = sum((x - ma) * (y - mb) for x, y in zip(ra, rb, strict=True))
    va = sum((x - ma) ** 2 for x in ra)
    vb = sum((y - mb) ** 2 for y in rb)
    return cov / math.sqrt(va * vb) if va and vb else math.nan


def _group_value(row: dict[str, Any], metric: str) -> tuple[float, float] | None:
    """(measured, predicted) of a row in its group's ranking metric."""
    if metric == "tflops":
        pm = row.get("pred_megatron_tflops")
        if row["meas_tflops"] is None or pm is None:
            return None
        return row["meas_tflops"], pm
    if row["meas_tokens"] is None or row.get("pred_tokens") is None:
        return None
    return row["meas_tokens"], row["pred_tokens"]


def summarise(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Median |error|, shares within 15 / 25 %, and per rank group the order agreement."""
    errs = [abs(r["error"]) for r in rows if r.get("error") is not None]
    out: dict[str, Any] = {
        "runs": len(rows), "compared": len(errs),
        "median_abs_error": statistics.median(errs) if errs else None,
        "within_15": sum(e <= 0.15 for e in errs) / len(errs) if errs else None,
        "within_25": sum(e <= 0.25 for e in errs) / len(errs) if errs else None,
        "groups": {},
    }
    groups: dict[str, list[dict[str, Any]]] = {}
    for r in rows:
        if r.get("rank_group"):
            groups.setdefault(r["rank_group"], []).append(r)
    for g, members in sorted(groups.items()):
        metric = members[0]["rank_metric"]
        vals = [(r["id"], v) for r in members if (v := _group_value(r, metric)) is not None]
        meas, pred = [v[0] for _, v in vals], [v[1] for _, v in vals]
        agree, total = order_agreement(meas, pred)
        out["groups"][g] = {
            "metric": metric, "members": len(members), "ranked": len(vals),
            "pairs_agree": agree, "pairs": total,
            "order_equal": total > 0 and agree == total, "spearman": spearman(meas, pred),
            "measured_order": [i for i, _ in sorted(vals, key=lambda t: -t[1][0])],
            "predicted_order": [i for i, _ in sorted(vals, key=lambda t: -t[1][1])],
        }
    return out


@functools.cache
def forward_host_floor_ms(layer_ms: float, source: tuple[str, ...] = tuple(FLOOR_SOURCE_FLAGS),
                          layers_x_microbatches: int = FLOOR_SOURCE_LAYERS_X_MICROBATCHES
                          ) -> float:
    """The host's share of a measured host-bound layer time `layer_ms` (forward + backward of
    one MoE layer and micro-batch of the run whose `tuner estimate` flags are `source`: by
    default FLOOR_SOURCE_FLAGS): `layer_ms` minus the backward's device time the estimate
    gives that run without a floor (2/3 of its compute + exchange per layer and micro-batch:
    recompute none)."""
    est = run_estimate(list(source), timeout=300.0)
    device = est["time_s"]["compute"] + est["time_s"]["alltoall"]
    backward_ms = 1e3 * device * 2 / 3 / layers_x_microbatches
    if not 0 < backward_ms < layer_ms:
        raise RuntimeError(f"host floor: backward device {backward_ms:.3g} ms per layer is not "
                           f"below the measured {layer_ms} ms; the source row is not host-bound")
    return layer_ms - backward_ms


@functools.cache
def _cli_help() -> str:
    p = subprocess.run([sys.executable, "-m", "tuner", "estimate", "--help"], cwd=ROOT,
                       capture_output=True, text=True)
    return p.stdout if p.returncode == 0 else ""


def run_estimate(flags: list[str], timeout: float) -> dict[str, Any]:
    """The JSON object `python -m tuner estimate <flags> --json` prints last; raises
    RuntimeError with the CLI's last stderr line when it fails."""
    cmd = [sys.executable, "-m", "tuner", "estimate", *flags, "--json"]
    p = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout)
    lines = [ln for ln in p.stdout.splitlines() if ln.strip()]
    if p.returncode != 0 or not lines:
        err = [ln for ln in p.stderr.splitlines() if ln.strip()]
        raise RuntimeError(err[-1] if err else f"exit {p.returncode}, no output")
    return json.loads(lines[-1])


def _megatron_check(run: dict[str, Any], meas: dict[str, Any]) -> float | None:
    """Our Megatron-formula TFLOP/s at the measured tokens/s over the printed TFLOP/s (checks
    tuner.flops against the source's formula, independent of any timing); None if n/a."""
    if meas["tokens"] is None or meas["tflops"] is None or meas["convention"] != "megatron" \
            or not run.get("preset", True):
        return None
    try:
        from model import presets
        from tuner.flops import megatron_flops_per_token
    except ImportError:
        return None
    mtp = run.get("mtp_layers", 0)
    tp = run["tp"] if isinstance(run.get("tp"), int) else 1
    f = megatron_flops_per_token(presets.get(run["model"]), run["seq"],
                                 mtp if isinstance(mtp, int) else 0, 128 * tp)
    return f * meas["tokens"] / 1e12 / meas["tflops"]


def evaluate(run: dict[str, Any], extra: list[str], timeout: float,
             fp8_peak_factor: float | None = None,
             runs: dict[str, dict[str, Any]] | None = None) -> dict[str, Any]:
    """One result row: the run, its flags, the prediction and the comparison.
    `fp8_peak_factor`: passed as `--fp8-peak-factor` to FP8 runs (an assumption, listed);
    `runs`: the runs file's runs by id (`estimate_flags`)."""
    meas = measured(run)
    row: dict[str, Any] = {
        "bench": "tuner_published", "sha": git_sha(), "time": time.strftime("%Y-%m-%dT%H:%M:%S"),
        "id": run["id"], "model": run["model"], "platform": run["platform"],
        "rank_group": run.get("rank_group", ""), "rank_metric": run.get("rank_metric", "tokens"),
        "meas_tokens": meas["tokens"], "meas_tokens_from": meas["tokens_from"],
        "meas_tflops": meas["tflops"], "flops_convention": meas["convention"],
        "megatron_formula_ratio": _megatron_check(run, meas),
        "status": "predicted", "error": None, "assumed": [],
    }
    why = skip_reason(run)
    if why:
        row["status"] = f"skipped: {why}"
        return row
    flags, row["assumed"] = estimate_flags(run, runs)
    if fp8_peak_factor is not None and _flag_value(flags, "--precision") == "fp8":
        flags += ["--fp8-peak-factor", str(fp8_peak_factor)]
        row["assumed"].append(f"fp8_peak_factor={fp8_peak_factor} (--fp8-peak-factor)")
    flags += extra
    row["flags"] = flags
    try:
        pred = run_estimate(flags, timeout)
    except (RuntimeError, subprocess.TimeoutExpired, json.JSONDecodeError) as e:
        row["status"] = f"error: {e}"
        return row
    row.update(pred_tokens=pred.get("tokens_per_s_per_gpu"),
               pred_step_time_s=pred.get("step_time_s"),
               pred_megatron_tflops=pred.get("megatron_tflops_per_gpu"),
               pred_model_tflops=pred.get("model_tflops_per_gpu"), pred_mfu=pred.get("mfu"),
               pred_peak_memory_gb=pred.get("peak_memory_gb"), fits=pred.get("fits"),
               runnable=pred.get("runnable"),
               not_runnable_because=pred.get("not_runnable_because"))
    cmp_ = predicted(meas, pred)
    if cmp_ is None:
        row["status"] = "predicted: nothing to compare in the source's terms"
        return row
    row["metric"], row["pred_value"], row["meas_value"] = cmp_
    err = cmp_[1] / cmp_[2] - 1
    if run.get("floor_layout"):  # its layout is its host floor's source: ranked, not summarised
        row["status"] = "predicted: the layout its host floor was measured on (not summarised)"
        row["floor_layout_error"] = err
        return row
    row["error"] = err
    return row


def _flag_value(flags: list[str], name: str) -> str | None:
    return flags[flags.index(name) + 1] if name in flags else None


def _fmt(v: Any, spec: str = ".4g") -> str:
    return "-" if v is None else format(v, spec)


def markdown(rows: list[dict[str, Any]], s: dict[str, Any]) -> str:
    out = [f"# Published MoE runs predicted by `tuner estimate` (commit {git_sha()})", "",
           "error = predicted / measured - 1. Runs and sources: "
           "benchmarks/data/published_runs.toml, docs/reference.md section 5.", "",
           "| run | metric | measured | predicted | error | Megatron formula / printed | "
           "fits | runnable (missing) | assumed |", "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if r.get("floor_layout_error") is not None:
            out.append(f"| `{r['id']}` | {r['metric']} | {r['meas_value']:.4g} | "
                       f"{r['pred_value']:.4g} | ({100 * r['floor_layout_error']:+.1f} %: its "
                       f"host floor's layout, not summarised) | "
                       f"{_fmt(r['megatron_formula_ratio'], '.3f')} | {r.get('fits')} | "
                       f"{r.get('runnable')} | {', '.join(r['assumed'])} |")
            continue
        if r.get("error") is None:
            out.append(f"| `{r['id']}` | {r['status']} | | | | "
                       f"{_fmt(r['megatron_formula_ratio'], '.3f')} | | | |")
            continue
        miss = "; ".join(r.get("not_runnable_because") or [])
        out.append(
            f"| `{r['id']}` | {r['metric']} | {r['meas_value']:.4g} | {r['pred_value']:.4g} | "
            f"{100 * r['error']:+.1f} % | {_fmt(r['megatron_formula_ratio'], '.3f')} | "
            f"{r.get('fits')} | {r.get('runnable')}{f' ({miss})' if miss else ''} | "
            f"{', '.join(r['assumed'])} |")
    out += ["", f"Compared {s['compared']} of {s['runs']} runs: median |error| "
            f"{_fmt(s['median_abs_error'] and 100 * s['median_abs_error'], '.1f')} %, within "
            f"15 %: {_fmt(s['within_15'] and 100 * s['within_15'], '.0f')} %, within 25 %: "
            f"{_fmt(s['within_25'] and 100 * s['within_25'], '.0f')} % "
            "(target: median <= 15 %, >= 80 % within 25 %).", "",
            "| rank group | metric | ranked | pairs ordered alike | Spearman | order equal | "
            "measured order (best first) | predicted order |", "|---|---|---|---|---|---|---|---|"]
    for g, v in s["groups"].items():
        out.append(f"| {g} | {v['metric']} | {v['ranked']}/{v['members']} | "
                   f"{v['pairs_agree']}/{v['pairs']} | {_fmt(v['spearman'], '.2f')} | "
                   f"{v['order_equal']} | {', '.join(v['measured_order'])} | "
                   f"{', '.join(v['predicted_order'])} |")
    return "\n".join(out) + "\n"


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--runs", type=Path, default=DATA, help="published runs (TOML)")
    ap.add_argument("--only", default="", help="run ids starting with this prefix")
    ap.add_argument("--timeout", type=float, default=300.0, help="seconds per estimate")
    ap.add_argument("--jobs", type=int, default=1,
                    help="estimates run at once (each is one Python process; default 1)")
    ap.add_argument("--fp8-peak-factor", type=float, default=None,
                    help="FP8 / bf16 GEMM peak passed to FP8 runs, for platform files without an "
                         "FP8 rate (an assumption, listed per row; none by default)")
    ap.add_argument("--estimate-args", default="",
                    help="extra flags for every `tuner estimate` call (one string)")
    add_output_args(ap, "tuner_published")
    return ap


def main(argv: list[str] | None = None) -> None:
    args = parser().parse_args(argv)
    every = load_runs(args.runs)
    by_id = {r["id"]: r for r in every}  # a run's host_floor may name one --only leaves out
    runs = [r for r in every if r["id"].startswith(args.only)]
    if not runs:
        raise SystemExit(f"no run id starts with {args.only!r} in {args.runs}")
    help_text = _cli_help()
    if not help_text:
        raise SystemExit("`python -m tuner estimate --help` failed: this checkout has no "
                         "estimate command (issue 33 item 6)")
    extra = [x for flag, val in OPTIONAL_FLAGS if flag in help_text for x in (flag, val)]
    extra += args.estimate_args.split()
    if args.jobs < 1:
        raise SystemExit(f"--jobs {args.jobs} must be >= 1")
    with ThreadPoolExecutor(args.jobs) as pool:  # threads only wait on the subprocesses
        rows = list(pool.map(lambda r: evaluate(r, extra, args.timeout, args.fp8_peak_factor,
                                                by_id),
                             runs))
    for row in rows:
        e = row["error"]
        print(f"{row['id']}: {row['status']}" + ("" if e is None else f", {100 * e:+.1f} %"))
    s = summarise(rows)
    out = output_dir(args)
    with open(out / "tuner_published.jsonl", "a") as fh:
        fh.writelines(json.dumps(r, default=str) + "\n" for r in rows)
    md = markdown(rows, s)
    (out / "tuner_published.md").write_text(md)
    print(md)
    print_written(out / "tuner_published.jsonl", out / "tuner_published.md")


if __name__ == "__main__":
    main()
