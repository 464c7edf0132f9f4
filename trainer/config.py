"""Run configuration: one plain dataclass per concern, composed into `RunConfig`.

Sources, later ones win: dataclass defaults -> TOML file (`--config FILE`) -> a plan file
(`--plan FILE`, written by `python -m tuner plan`) -> CLI overrides `--section.field=value`.
Convenience flags: `--data PATH` (= `--data.path=PATH`), `--resume [PATH]` (= `--train.resume`).

The `[model]` section takes `preset = "<name>"` (or `hf_path = "<Hugging Face checkpoint folder>"`)
plus any `model.ModelConfig` field as an override.
"""

from __future__ import annotations

import dataclasses
import json
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

__all__ = [
    "ModelSection",
    "ParallelConfig",
    "CommConfig",
    "DataConfig",
    "OptimConfig",
    "TrainConfig",
    "BalanceConfig",
    "DebugConfig",
    "RunConfig",
    "ConfigError",
    "load_config",
    "parse_args",
]


class ConfigError(ValueError):
    """A user-facing configuration mistake; the message names the value and what is valid."""


def opt(default: Any, help: str, valid: str, *, factory: Any = None) -> Any:
    """A config field with its one-line meaning and its valid values (what `--help` prints)."""
    meta = {"help": help, "valid": valid}
    if factory is not None:
        return field(default_factory=factory, metadata=meta)
    return field(default=default, metadata=meta)


@dataclass
class ModelSection:
    preset: str = opt("tiny", "model preset (model/presets.py); ignored with hf_path",
                      "a name of model.presets.names()")
    hf_path: str = opt("", "a Hugging Face checkpoint folder (config.json + *.safetensors): the "
                           "architecture from its config.json, the initial weights from its "
                           "tensors (each rank reads what it holds); other [model] fields still "
                           "override", '"" (use the preset) or a folder')
    overrides: dict[str, Any] = opt(None, "any model.ModelConfig field given as [model] "
                                          "<field> (or --model.<field>=value)",
                                    "the ModelConfig field's type", factory=dict)


@dataclass
class ParallelConfig:
    pp: int = opt(1, "pipeline-parallel degree (stages over ranks)", "int >= 1")
    ep: int = opt(1, "expert-parallel degree (each MoE layer's experts split over ep ranks)",
                  "int >= 1 dividing the number of experts")
    dp: int = opt(0, "data-parallel degree", "0 (= world / (pp * ep); EP folds over TP) or int >= 1")
    schedule: str = opt("1f1b", "pipeline schedule (with pp > 1; validated with pp = 1 too)",
                        "gpipe, 1f1b, interleaved-1f1b, zb-h1")
    microbatches: int = opt(1, "micro-batches per step: pipeline micro-batches with pp > 1, "
                               "gradient accumulation with pp = 1 (one gradient sync after the "
                               "last)", "int >= 1 dividing each rank's batch")
    zero: int = opt(0, "sharding over each parameter's data-parallel replicas: 0 replicated, 1 "
                       "optimizer state (ZeRO-1), 2 + gradients (ZeRO-2), 3 + parameters, "
                       "gathered per layer (FSDP2, trainer/distributed/zero3.py)", "0, 1, 2, 3")
    grad_overlap: str = opt("auto", "reduce gradients in buckets as the backward produces them "
                                    "(DDP-style); auto = on with ZeRO-1/2 and on GPUs, off for "
                                    "ZeRO-0 on CPU", "true, false, auto")
    n_virtual: int = opt(1, "virtual stages per PP rank", "1, or >= 2 with "
                                                          "schedule=interleaved-1f1b")
    layer_split: str = opt("", "layers per pipeline stage", '"" (as even as possible) or '
                                                            'comma-separated counts, e.g. "3,5"')
    ep_placement: str = opt("local", "where EP groups sit: local = consecutive ranks (inside a "
                                     "node); spread = EP outermost, one rank from each of ep "
                                     "blocks of pp * dp ranks (trainer/distributed/mesh.py)", "local, spread")
    tp: int = opt(1, "tensor parallel of the dense side (attention, dense FFNs, shared experts, "
                     "head) over tp consecutive ranks of a stage; experts stay on EP, whose "
                     "groups span the TP ranks (trainer/distributed/tensor_parallel.py)",
                  "int >= 1 dividing the heads and FFN widths")
    sp: bool = opt(True, "sequence parallel with tp > 1: norms, residuals and the router input "
                         "split over the sequence between the TP regions; false: replicated "
                         "there (each token still routed once)", "true, false")
    etp: int = opt(1, "expert tensor parallel (not built)", "1")


@dataclass
class CommConfig:
    alltoall: str = opt("auto", "the expert all-to-all (trainer.layout.TRAINER_ALLTOALL)",
                        "flat, halo, dedup, auto")
    a2a_overlap: str = opt("none", "the expert all-to-all overlapped with compute: layer = "
                                   "shared experts beside the dispatch, rows in a2a_chunks "
                                   "chunks pipelined (comm/ep/pipeline.py); fb = layer, and "
                                   "one micro-batch's forward beside another's backward "
                                   "exchanges (parallel.microbatches >= 2; with pp > 1 the "
                                   "1f1b and interleaved-1f1b schedules); auto "
                                   "(trainer.layout.auto_overlap) = none inside one node or "
                                   "with tp > 1; across nodes fb with 2 chunks where fb runs "
                                   "and the planner's memory of fb fits 0.9 of the free "
                                   "memory on every rank, else layer with 2 chunks; logged "
                                   "with its reason", "none, layer, fb, auto")
    a2a_chunks: str = opt("auto", "chunks of the layer pipeline", "an int >= 1, or auto")
    auto_trial: int = opt(2, "where alltoall or a2a_overlap is auto and has choices left (EP "
                             "across nodes), the first 1 + auto_trial x choices training steps "
                             "run each choice in turn, auto_trial rounds of them, and the rest "
                             "of the run uses the fastest (trainer/a2a_trial.py); 0 = the "
                             "rules decide", "an int >= 0")
    route_groups: str = opt("none", "node: the model's routing groups (--model.n_group, a "
                                    "multiple of the EP group's nodes) are bound to nodes, so a "
                                    "token reaches at most --model.topk_group nodes and "
                                    "migration keeps every expert on its group's node",
                            "none, node")
    topology: str = opt("", "topology file of the nodes and their ranks",
                        '"" (discovered) or a TOML file (configs/topologies/)')


@dataclass
class DataConfig:
    path: str = opt("", "training text or tokens", '"" (the running interpreter\'s standard '
                                                   'library sources), a file, a folder, a '
                                                   'tokenized .bin, Parquet/Arrow')
    val_fraction: float = opt(0.005, "share of the tokens held out for validation",
                              "0 < x < 0.5")
    seed: int = opt(1234, "seed of the window order and the train/validation split", "any int")
    doc_mask: bool = opt(False, "attention stays inside each document of a packed window (EOS "
                                "ends one) and RoPE positions restart per document; needs a "
                                "tokenized .bin whose sidecar names eos_id", "true, false")
    sampling: str = opt("epoch", "training windows: epoch = every window once per epoch in a "
                                 "seeded shuffled order; random = offsets drawn with "
                                 "replacement (trainer/data/sampling.py)", "epoch, random")
    blend: str = opt("", "several token files in fixed shares (instead of path), each walked "
                         "in its own epochs", '"" or "a.bin:0.7,b.bin:0.3"')
    loss_mask: bool = opt(False, "the loss counts only tokens the data's loss mask keeps "
                                 "(FILE.mask of `prepare --chat`: the assistant turns)",
                          "true, false")
    doc_attention: str = opt("auto", "attention kernel under doc_mask: flex = block mask, dense "
                                     "= [B, 1, S, S] mask (model/attention.py)",
                             "auto, flex, dense")


@dataclass
class OptimConfig:
    lr: float = opt(3e-3, "peak AdamW learning rate (after warm-up)", "> 0")
    min_lr: float = opt(3e-4, "learning rate at the end of the cosine decay", "0 <= x <= lr")
    warmup_steps: int = opt(20, "steps of linear warm-up", "int >= 0")
    weight_decay: float = opt(0.1, "AdamW decoupled weight decay", ">= 0")
    beta1: float = opt(0.9, "AdamW first-moment decay", "0 <= x < 1")
    beta2: float = opt(0.95, "AdamW second-moment decay", "0 <= x < 1")
    eps: float = opt(1e-8, "AdamW epsilon", "> 0")
    grad_clip: float = opt(1.0, "clip the global gradient norm to this", "> 0, or 0 = off")


@dataclass
class BalanceConfig:
    enabled: bool = opt(False, "expert migration during training (balance/, "
                               "trainer/balancing.py)", "true, false")
    threshold: float = opt(1.2, "migrate a layer when its EP-rank load max / mean over the "
                                "window exceeds this", ">= 1")
    window: int = opt(10, "steps of expert counts the policy averages", "int >= 1")
    cooldown: int = opt(20, "steps between two migrations of a layer", "int >= 0")
    max_swaps: int = opt(8, "expert swaps per migration at most", "int >= 0")
    method: str = opt("default", "swap planner", "default (= minmax), minmax, hill-climb, "
                                                 "greedy-repack")
    redundant: int = opt(0, "redundant expert slots per EP rank (issue 20): each rank hosts "
                            "E / ep + redundant slots and hot experts get replicas "
                            "(balance.plan_replicas)", "int >= 0, at most E - E / ep")


@dataclass
class TrainConfig:
    steps: int = opt(200, "optimizer steps of the run", "int >= 1")
    global_batch: int = opt(16, "sequences per optimizer step, summed over all data-parallel "
                                "ranks", "int >= 1, a multiple of the data shards")
    seq_len: int = opt(256, "tokens per training window", "1 .. the model's max_seq_len")
    seed: int = opt(0, "seed of the initial weights", "any int")
    log_every: int = opt(1, "steps between two console progress lines", "int >= 1")
    eval_every: int = opt(50, "steps between two validation passes (and one at the end)",
                          "int >= 0 (0 = only at the end)")
    eval_batches: int = opt(8, "validation batches of global_batch sequences", "int >= 1")
    ckpt_every: int = opt(0, "steps between two checkpoints (and one at the end)",
                          "int >= 0 (0 = only at the end)")
    ckpt_keep: int = opt(2, "complete checkpoints kept in <out_dir>/checkpoints", "int >= 1")
    stop_after: int = opt(0, "end this invocation after that many total steps (checkpointed); "
                             "continue with --resume", "int >= 0 (0 = run to steps)")
    out_dir: str = opt("runs/default", "folder of metrics.jsonl, checkpoints, plots", "a path")
    resume: str = opt("", "continue from a checkpoint: latest = the newest complete one in "
                          "out_dir (error if none); auto = the newest if any, else start "
                          "fresh (for torchrun --max-restarts)",
                      '"" (no), latest, auto, or a checkpoint path')
    replan: str = opt("off", "an attempt whose world size differs from its checkpoint's: auto "
                             "= rank 0 re-plans the layout with the planner (same model, seq "
                             "and global batch; trainer/elastic.py), off = keep the configured "
                             "layout and refuse when it does not fit", "auto, off")
    replan_trials: int = opt(100, "planner trials of an elastic re-plan", "int >= 1")
    platform: str = opt("", "platform file of an elastic re-plan", '"" (the --plan file\'s '
                            'platform, else local), a name under configs/platforms, or a path')
    dtype: str = opt("auto", "compute dtype (trainer/distributed/precision.py); auto = bf16 on GPUs, fp32 "
                             "on CPU (bf16 really runs on CPU too)", "auto, fp32, bf16")
    param_dtype: str = opt("auto", "working weights (fp32 masters + AdamW moments stay in the "
                                   "optimizer, gradients fp32); auto = the compute dtype",
                           "auto, fp32, bf16")
    reduce_dtype: str = opt("fp32", "dtype of the gradient reduction on the wire", "fp32, bf16")
    compile: bool = opt(False, "each block's attention, norms, router and dense FFN through "
                               "torch.compile (the MoE dispatch, expert GEMMs and combine stay "
                               "eager): trainer/compile.py", "true, false")
    peak_tflops: float = opt(0.0, "peak TFLOP/s per device for the MFU",
                             "> 0, or 0 = the known GPU peak / a measured matmul rate on CPU")
    plot: bool = opt(True, "write <out_dir>/loss.png at the end", "true, false")
    checkpointing: str = opt("none", "activation checkpointing (model/checkpointing.py)",
                             "none, selective, full")
    memory_report: bool = opt(False, "log per-rank state bytes and peak saved-activation bytes "
                                     "(max over ranks)", "true, false")
    memory_report_every: int = opt(1, "with memory_report: meter every Nth step only (the "
                                      "saved-tensor hooks cost Python time per saved tensor, "
                                      "2-6 % of a tiny CPU step), so the other steps time a "
                                      "plain step", "int >= 1")
    export_hf: str = opt("", "at the end, also write a Hugging Face checkpoint here "
                             "(trainer.export)", '"" or a folder')
    trace_counts: bool = opt(False, "write per-step, per-expert token counts to "
                                    "<out_dir>/counts.jsonl", "true, false")
    layer_metrics: bool = opt(True, "per-MoE-layer load and router entropy in metrics.jsonl "
                                    "and the sinks (docs/observability.md)", "true, false")
    tensorboard: str = opt("auto", "TensorBoard under <out_dir>/tensorboard; auto = on when the "
                                   "tensorboard package is installed", "true, false, auto")
    wandb_project: str = opt("", "Weights & Biases project", '"" (off) or a project name')
    wandb_mode: str = opt("offline", "Weights & Biases mode (offline: no network; `wandb sync` "
                                     "later)", "offline, online")
    profile_steps: str = opt("", "torch.profiler traces of steps A..B under <out_dir>/profile/",
                             '"" or "A,B" (1 <= A <= B <= steps)')
    threads: int = opt(0, "torch intra-op threads per process", "int >= 0 (0 = cores / local "
                                                                "processes)")
    cpu_affinity: str = opt("auto", "single-node CPU runs: pin each rank to its own cores "
                                    "when the processes x threads fill the cores exactly "
                                    "(comm/tools/affinity.py); none leaves placement to the "
                                    "OS; GPU runs are never pinned", "auto, none")
    timeout_s: float = opt(600.0, "a collective or P2P waiting longer than this many seconds "
                                  "fails the run", "> 0")
    nan_policy: str = opt("skip", "a non-finite loss or gradient: skip the step (up to "
                                  "max_nonfinite_steps) or stop", "skip, stop")
    max_nonfinite_steps: int = opt(3, "non-finite steps skipped before the run stops",
                                   "int >= 0")


@dataclass
class DebugConfig:
    """Test and benchmark knobs: not for training runs. Fault injection for the tests and the
    chaos harness (benchmarks/chaos.py), a skewed router and forced migrations for the balance
    tests and benchmarks, alternating logging for benchmarks/bench_logging.py, the data-order
    trace for tests/test_data_sampling.py."""

    fault_rank: int = opt(0, "the rank the fault_* injections hit", "0 .. world size - 1")
    fault_nan_step: int = opt(0, "at that step the loss and one gradient of fault_rank become "
                                 "NaN", "int >= 0 (0 = never)")
    fault_stall_step: int = opt(0, "at that step fault_rank stops responding (sleeps) before its "
                                   "forward", "int >= 0 (0 = never)")
    logging_ab: bool = opt(False, "layer_metrics and TensorBoard on odd steps only, so one run "
                                  "measures steps with and without them under the same machine "
                                  "load (benchmarks/bench_logging.py)", "true, false")
    skew: float = opt(0.0, "a fixed router selection bias -skew * ln(1 + e) for logical expert "
                           "e, so the first experts (all on EP rank 0 at start) are hot "
                           "(benchmarks/bench_migration.py, chaos.py)", "a finite number (0 = off)")
    force_every: int = opt(0, "with balance.enabled: migrate every N steps regardless of "
                              "imbalance (swap one expert pair per rank pair, or move every "
                              "replica)", "int >= 0 (0 = off)")
    trace_data: bool = opt(False, "each rank appends the windows it reads per step to "
                                  "<out_dir>/data_order.rank<r>.jsonl, in the schema of "
                                  "`python -m trainer.data order`", "true, false")


@dataclass
class RunConfig:
    model: ModelSection = field(default_factory=ModelSection)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    comm: CommConfig = field(default_factory=CommConfig)
    data: DataConfig = field(default_factory=DataConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    balance: BalanceConfig = field(default_factory=BalanceConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    debug: DebugConfig = field(default_factory=DebugConfig)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


_SECTIONS = {f.name: f.type for f in dataclasses.fields(RunConfig)}


def _coerce(section: str, name: str, value: Any, current: Any) -> Any:
    """Convert a CLI string (or TOML value) to the type of the field's current value."""
    if isinstance(current, bool):
        if isinstance(value, bool):
            return value
        s = str(value).lower()
        if s in ("1", "true", "yes", "on"):
            return True
        if s in ("0", "false", "no", "off"):
            return False
        raise ConfigError(f"--{section}.{name}={value!r}: expected a boolean (true/false)")
    if isinstance(current, int) and not isinstance(current, bool):
        try:
            if isinstance(value, float) and not value.is_integer():
                raise ValueError
            return int(value)
        except (TypeError, ValueError):
            raise ConfigError(f"--{section}.{name}={value!r}: expected an integer") from None
    if isinstance(current, float):
        try:
            return float(value)
        except (TypeError, ValueError):
            raise ConfigError(f"--{section}.{name}={value!r}: expected a number") from None
    return value if not isinstance(current, str) else str(value)


def _parse_literal(text: str) -> Any:
    """Parse a CLI model override value with TOML's scalar grammar (so 1e-3, true, "x" work)."""
    try:
        return tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        return text


def _apply(cfg: RunConfig, section: str, name: str, value: Any, *, from_cli: bool) -> None:
    if section not in _SECTIONS:
        raise ConfigError(f"unknown config section {section!r}; valid: {', '.join(_SECTIONS)}")
    sec = getattr(cfg, section)
    if section == "model" and name not in ("preset", "hf_path"):
        cfg.model.overrides[name] = _parse_literal(value) if from_cli else value
        return
    names = [f.name for f in dataclasses.fields(sec)]
    if name not in names:
        raise ConfigError(f"unknown option {section}.{name}; valid: {', '.join(names)}")
    setattr(sec, name, _coerce(section, name, value, getattr(sec, name)))


def apply_dict(cfg: RunConfig, data: dict[str, Any], source: str) -> None:
    for section, body in data.items():
        if section not in _SECTIONS:
            raise ConfigError(f"{source}: unknown section [{section}]; valid: {', '.join(_SECTIONS)}")
        if not isinstance(body, dict):
            raise ConfigError(f"{source}: [{section}] must be a table, got {body!r}")
        for name, value in body.items():
            _apply(cfg, section, name, value, from_cli=False)


def load_config(path: str | Path) -> dict[str, Any]:
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"config file {str(p)!r} does not exist")
    try:
        return tomllib.loads(p.read_text())
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"config file {str(p)!r} is not valid TOML: {e}") from None


def parse_args(argv: list[str]) -> RunConfig:
    """Build the run config from argv (see module docstring for precedence)."""
    cfg = RunConfig()
    files: list[tuple[str, str]] = []
    overrides: list[tuple[str, str, str]] = []
    i = 0
    while i < len(argv):
        arg = argv[i]
        if arg in ("-h", "--help"):
            print(_help())
            raise SystemExit(0)
        if not arg.startswith("--"):
            raise ConfigError(f"unexpected argument {arg!r}; options look like --section.field=value")
        key, eq, value = arg[2:].partition("=")
        takes_value = key in ("config", "plan", "data")
        if not eq and takes_value:
            if i + 1 >= len(argv):
                raise ConfigError(f"--{key} needs a value")
            value = argv[i + 1]
            i += 1
        if key in ("config", "plan"):
            files.append((key, value))
        elif key == "data":
            overrides.append(("data", "path", value))
        elif key == "resume":
            overrides.append(("train", "resume", value if eq else "latest"))
        elif "." in key:
            if not eq:
                raise ConfigError(f"--{key} needs a value: --{key}=VALUE")
            section, _, name = key.partition(".")
            overrides.append((section, name, value))
        else:
            raise ConfigError(
                f"unknown option --{key}; use --config FILE, --plan FILE, --data PATH, --resume, "
                f"or --section.field=value with sections {', '.join(_SECTIONS)}"
            )
        i += 1
    for kind, path in sorted(files, key=lambda f: f[0] == "plan"):  # config before plan
        data = load_config(path)
        if kind == "plan":
            planned_on = (data.get("plan") or {}).get("platform")
            if isinstance(planned_on, str) and planned_on:  # re-plans price the same platform
                cfg.train.platform = planned_on
            data = data.get("run", data)  # plan files keep the run config under [run.*]
        apply_dict(cfg, data, path)
    for section, name, value in overrides:
        _apply(cfg, section, name, value, from_cli=True)
    return cfg


def _help() -> str:
    """Every section and field: its default, what it means and its valid values (the fields'
    `opt` docs), section by section."""
    lines = [
        "usage: torchrun --nproc-per-node N train.py [--config FILE] [--plan FILE] [--data PATH]",
        "                [--resume [PATH]] [--section.field=value ...]",
        "",
        "  --config FILE    a TOML run config ([section] tables of the fields below)",
        "  --plan FILE      a plan file of `python -m tuner plan` (its [run.*] tables)",
        "  --data PATH      = --data.path=PATH",
        "  --resume [PATH]  = --train.resume=PATH (latest without PATH)",
        "Later sources win: defaults, --config, --plan, then --section.field=value.",
    ]
    for name in _SECTIONS:
        sec = getattr(RunConfig(), name)
        doc = (type(sec).__doc__ or "") if name == "debug" else ""
        lines += ["", f"[{name}]" + (f"  {' '.join(doc.split())}" if doc else "")]
        for f in dataclasses.fields(sec):
            if name == "model" and f.name == "overrides":
                lines.append("  --model.<field>=VALUE  " + f.metadata["help"]
                             + f"; valid: {f.metadata['valid']}")
                continue
            valid = f.metadata["valid"]
            if name == "model" and f.name == "preset":
                from model import presets

                valid += ": " + ", ".join(presets.names())
            lines.append(f"  --{name}.{f.name}={json.dumps(getattr(sec, f.name))}  {f.metadata['help']}; "
                         f"valid: {valid}")
    return "\n".join(lines)
