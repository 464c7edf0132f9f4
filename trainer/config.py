"""Run configuration: one plain dataclass per concern, composed into `RunConfig`.

Sources, later ones win: dataclass defaults -> TOML file (`--config FILE`) -> a plan file
(`--plan FILE`, written by `python -m tuner plan`) -> CLI overrides `--section.field=value`.
Convenience flags: `--data PATH` (= `--data.path=PATH`), `--resume [PATH]` (= `--train.resume`).

The `[model]` section takes `preset = "<name>"` (or `hf_path = "<Hugging Face checkpoint folder>"`)
plus any `model.ModelConfig` field as an override.
"""

from __future__ import annotations

import dataclasses
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
    "RunConfig",
    "ConfigError",
    "load_config",
    "parse_args",
]


class ConfigError(ValueError):
    """A user-facing configuration mistake; the message names the value and what is valid."""


@dataclass
class ModelSection:
    preset: str = "tiny"
    # a Hugging Face checkpoint folder (config.json + *.safetensors): the architecture comes from
    # its config.json (the preset is ignored) and the initial weights from its tensors, each
    # rank reading only what it holds; other [model] fields still override (e.g. n_layers)
    hf_path: str = ""
    overrides: dict[str, Any] = field(default_factory=dict)


@dataclass
class ParallelConfig:
    pp: int = 1
    ep: int = 1
    dp: int = 0  # 0 = infer from the world size: world / (pp * ep)
    schedule: str = "1f1b"
    # micro-batches per step: pipeline micro-batches with pp > 1, gradient accumulation with
    # pp = 1 (gradients are synchronised once, after the last)
    microbatches: int = 1
    # sharding over each parameter's data-parallel replicas: 0 = replicated, 1 = optimizer state
    # sharded (ZeRO-1), 2 = optimizer state and gradients sharded (ZeRO-2), 3 = parameters too,
    # gathered per layer (ZeRO-3, FSDP2: trainer/zero3.py)
    zero: int = 0
    # reduce gradients in buckets as the backward produces them (DDP-style overlap): true |
    # false | auto (= on with ZeRO-1/2 and on GPUs; off for ZeRO-0 on CPU, where gloo's
    # threads share the cores with the backward and the flat post-backward all-reduce is faster)
    grad_overlap: str = "auto"
    n_virtual: int = 1
    layer_split: str = ""  # layers per stage, e.g. "3,5"; "" = even split
    # "local": EP groups are consecutive ranks (inside a node); "spread": EP outermost, so an
    # EP group takes one rank from each of `ep` blocks of pp * dp ranks (see trainer/mesh.py)
    ep_placement: str = "local"
    # tensor parallel of the dense side (attention, dense FFNs, shared experts, head) over tp
    # consecutive ranks of a stage (trainer/tensor_parallel.py); experts stay on EP, whose
    # groups span the TP ranks (parallel folding, trainer/layout.py)
    tp: int = 1
    # sequence parallel (with tp > 1): norms, residuals and the router input split over the
    # sequence between the TP regions; false: replicated there (each token still routed once)
    sp: bool = True
    etp: int = 1  # expert tensor parallel: not built (only 1 is accepted)


@dataclass
class CommConfig:
    alltoall: str = "auto"  # flat | halo | dedup | auto (trainer.layout.TRAINER_ALLTOALL)
    # the expert all-to-all overlapped with compute: none | layer (shared experts beside the
    # dispatch, rows in a2a_chunks chunks pipelined: trainer/ep_pipeline.py) | auto (layer
    # where the EP group spans nodes, else none) (trainer.layout.TRAINER_A2A_OVERLAP)
    a2a_overlap: str = "none"
    a2a_chunks: str = "auto"  # chunks of the layer pipeline: an int >= 1, or auto
    # none | node: the model's routing groups (--model.n_group, a multiple of the EP group's
    # nodes) are bound to nodes, so a token reaches at most --model.topk_group nodes, and
    # migration keeps every expert on its group's node (balance.plan_swaps_within)
    route_groups: str = "none"
    topology: str = ""  # optional TOML topology file; default: discovered


@dataclass
class DataConfig:
    path: str = ""  # "" = the running interpreter's standard library sources
    val_fraction: float = 0.005
    seed: int = 1234
    # attention stays inside each document of a packed window (EOS ends a document) and RoPE
    # positions restart per document; needs a tokenized .bin whose sidecar names eos_id
    doc_mask: bool = False
    # training windows: "epoch" = every window once per epoch in a seeded shuffled order;
    # "random" = offsets drawn with replacement (trainer/data/sampling.py)
    sampling: str = "epoch"
    # several token files in fixed shares, "a.bin:0.7,b.bin:0.3" (instead of path), each
    # walked in its own epochs
    blend: str = ""
    # the loss counts only tokens the data's loss mask keeps (FILE.mask of `prepare --chat`:
    # the assistant turns)
    loss_mask: bool = False
    # attention kernel under doc_mask: auto | flex (block mask) | dense ([B, 1, S, S] mask);
    # see model/attention.py
    doc_attention: str = "auto"
    # test hook: each rank appends the windows it reads per step to
    # <out_dir>/data_order.rank<r>.jsonl, in the schema of `python -m trainer.data order`
    trace: bool = False


@dataclass
class OptimConfig:
    lr: float = 3e-3
    min_lr: float = 3e-4
    warmup_steps: int = 20
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-8
    grad_clip: float = 1.0


@dataclass
class BalanceConfig:
    enabled: bool = False
    threshold: float = 1.2
    window: int = 10
    cooldown: int = 20
    max_swaps: int = 8
    method: str = "default"
    force_every: int = 0  # test hook: migrate every N steps regardless of imbalance
    # Experiment knob: a fixed router selection bias -skew * ln(1 + e) for logical expert e, so
    # the first experts (all on EP rank 0 at start) are hot. 0 = off. Used by bench_migration.
    skew: float = 0.0
    # redundant expert slots per EP rank (issue 20): each rank hosts E / ep + redundant slots
    # and hot experts get replicas (balance.plan_replicas); 0 = one slot per expert
    redundant: int = 0


@dataclass
class TrainConfig:
    steps: int = 200
    global_batch: int = 16  # sequences per optimizer step, summed over all data-parallel ranks
    seq_len: int = 256
    seed: int = 0
    log_every: int = 1
    eval_every: int = 50
    eval_batches: int = 8  # validation batches of `global_batch` sequences
    ckpt_every: int = 0  # 0 = only at the end
    ckpt_keep: int = 2
    stop_after: int = 0  # end this invocation after that many total steps (checkpointed); 0 = run to `steps`
    out_dir: str = "runs/default"
    resume: str = ""  # "" = no; "latest" = newest complete checkpoint in out_dir (error if none);
    # "auto" = newest if any, else start fresh (for torchrun --max-restarts); or a path
    # elastic restarts (trainer/elastic.py): an attempt whose world size differs from its
    # checkpoint's re-plans the layout with the planner ("auto") or keeps the configured one
    # and refuses when it does not fit ("off"); the planner's trials and platform file (a name
    # under configs/platforms or a path; "" = the --plan file's platform, else "local")
    replan: str = "off"
    replan_trials: int = 100
    platform: str = ""
    # precision (trainer/precision.py): compute dtype auto (= bf16 on GPUs, fp32 on CPU) | fp32 |
    # bf16 (bf16 really runs on CPU too); working weights auto (= compute) | bf16 | fp32, with
    # fp32 masters + AdamW moments in the optimizer and fp32 gradients; the gradient reduction
    # on the wire in fp32 | bf16
    dtype: str = "auto"
    param_dtype: str = "auto"
    reduce_dtype: str = "fp32"
    # each block's attention, norms, router and dense FFN through torch.compile (the MoE
    # dispatch / expert GEMMs / combine stay eager): trainer/compile.py
    compile: bool = False
    peak_tflops: float = 0.0  # per device; 0 = known GPU peak, or a measured matmul rate on CPU
    plot: bool = True
    checkpointing: str = "none"  # activation checkpointing: none | selective | full (model/checkpointing.py)
    memory_report: bool = False  # log per-rank state bytes and peak saved-activation bytes (max over ranks)
    export_hf: str = ""  # at the end, also write a Hugging Face checkpoint here (trainer.export)
    trace_counts: bool = False  # write per-step, per-expert token counts to <out_dir>/counts.jsonl
    # observability (docs/observability.md): per-MoE-layer load and router entropy in
    # metrics.jsonl (and the sinks below); TensorBoard under <out_dir>/tensorboard: true | false
    # | auto (= on when the tensorboard package is installed); Weights & Biases when a project
    # is named; torch.profiler traces of steps "A,B" under <out_dir>/profile/
    layer_metrics: bool = True
    tensorboard: str = "auto"
    wandb_project: str = ""
    wandb_mode: str = "offline"  # offline (no network; `wandb sync` later) | online
    profile_steps: str = ""
    # benchmark hook (benchmarks/bench_logging.py): layer_metrics and TensorBoard on odd steps
    # only, so one run measures steps with and without them under the same machine load
    logging_ab: bool = False
    threads: int = 0  # torch intra-op threads per process; 0 = cores / local processes
    timeout_s: float = 600.0  # a collective or P2P waiting longer than this fails the run
    nan_policy: str = "skip"  # non-finite loss/grad: "skip" the step (up to max) or "stop"
    max_nonfinite_steps: int = 3
    # fault injection (tests, benchmarks/chaos.py): at that step, on rank `fault_rank`
    fault_rank: int = 0
    fault_nan_step: int = 0  # the loss and one gradient become NaN
    fault_stall_step: int = 0  # the rank stops responding (sleeps) before its forward


@dataclass
class RunConfig:
    model: ModelSection = field(default_factory=ModelSection)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    comm: CommConfig = field(default_factory=CommConfig)
    data: DataConfig = field(default_factory=DataConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    balance: BalanceConfig = field(default_factory=BalanceConfig)
    train: TrainConfig = field(default_factory=TrainConfig)

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
    lines = [
        "usage: torchrun --nproc-per-node N train.py [--config FILE] [--plan FILE] [--data PATH]",
        "                [--resume [PATH]] [--section.field=value ...]",
        "",
        "sections and fields (defaults):",
    ]
    for name in _SECTIONS:
        sec = getattr(RunConfig(), name)
        fields_ = ", ".join(f"{f.name}={getattr(sec, f.name)!r}" for f in dataclasses.fields(sec))
        lines.append(f"  [{name}] {fields_}")
    lines.append("  [model] also takes any model.ModelConfig field as an override; hf_path=DIR "
                 "starts from a Hugging Face checkpoint folder")
    return "\n".join(lines)
