"""Crash-safe distributed checkpoints with `torch.distributed.checkpoint` (DCP).

Layout under `<out_dir>/checkpoints/`:
    step_00000100/        a complete checkpoint: DCP shards + `.metadata` + `meta.json`
    step_00000200.tmp/    a save in progress (or killed mid-write): never read, removed later
    latest                text file naming the newest complete checkpoint (atomic os.replace)

A save writes into `step_N.tmp/`; only after every rank finished and rank 0 wrote `meta.json`
(fsync'ed) is the folder renamed to `step_N/` (an atomic rename) and `latest` updated. A crash at
any point therefore leaves the previous complete checkpoint untouched and discoverable.

Experts are stored by LOGICAL expert id (`model.<layer>.experts.w1.<e>`), not by rank or slot,
so a checkpoint loads under any EP degree or expert placement; the placement (every MoE
layer's slot map) lives in `meta.json` and is restored before the expert rows are read. Its
format: a layer without redundant slots keeps `expert2slot` [E] (each expert's slot: the
inverse of its slot map, as since before redundant slots), one with them `{"slots": slot map}`.
Optimizer state (AdamW exp_avg / exp_avg_sq / step) uses the same keys under `optim.<kind>.`.
Under ZeRO-1/2 (trainer/distributed/zero.py) each parameter's state lives on its owner only: the owner
contributes those keys (DCP writes each key once, from whichever rank has it), and a load fills
the state of the parameters the rank owns; the files are the same as a ZeRO-0 run's, so a run
resumes under any ZeRO level as under any EP/PP/DP layout. With bf16 weights
(trainer/distributed/precision.py) the `model.` keys hold the fp32 masters (written by the rank that steps
them), so a bf16 and an fp32 run read each other's checkpoints.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException

from model import MoELayer, MoETransformer

from .distributed.precision import has_main_grad

__all__ = ["CheckpointError", "save_checkpoint", "load_checkpoint", "find_latest", "list_complete",
           "named_moe_layers", "restore_placement"]

_STEP_RE = re.compile(r"^step_(\d{8})$")


class CheckpointError(ValueError):
    """A checkpoint is missing, incomplete, corrupt or from another model."""


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def named_moe_layers(model: MoETransformer) -> dict[str, MoELayer]:
    """{qualified module name: MoE layer} of the layers this rank holds."""
    ids = {id(m) for m in model.moe_layers()}
    return {name: m for name, m in model.named_modules()
            if isinstance(m, MoELayer) and id(m) in ids}


def _expert_rows(model: MoETransformer) -> dict[str, list[tuple[int, int]]]:
    """For each expert param name: [(local row, logical expert)] held by this rank."""
    out: dict[str, list[tuple[int, int]]] = {}
    for lname, layer in named_moe_layers(model).items():
        El = layer.experts.w1.shape[0]
        lo = _slot_offset(layer, layer.n_slots, El)
        slot2expert = layer.slot_map()  # replicas of one expert share its key
        for pname, _ in layer.experts.named_parameters():
            full = f"{lname}.experts.{pname}"
            out[full] = [(j, int(slot2expert[lo + j])) for j in range(El)]
    return out


def _slot_offset(layer: MoELayer, E: int, El: int) -> int:
    if El == E:
        return 0
    return dist.get_rank(layer.dispatcher.group) * El


def _weights(p: nn.Parameter, st: dict, load: bool) -> torch.Tensor | None:
    """The fp32 tensor a checkpoint holds for p: p itself (fp32 weights), its fp32 master
    (bf16 weights, on the rank that steps it), or, to load a bf16 weight this rank does not
    step, an fp32 buffer copied into it afterwards (`_finish_load`); None: nothing to save
    (another rank of p's replica group saves the master)."""
    if not has_main_grad(p):
        return p.data
    if "master" in st:
        return st["master"]
    return torch.empty(p.shape, dtype=torch.float32, device=p.device) if load else None


def _row(t: torch.Tensor, j: int) -> torch.Tensor:
    """A copy of expert row j of a [S, ...] stack; of a ZeRO-3 DTensor (sharded on a dim > 0,
    trainer/distributed/zero3.py) a DTensor of the row over the same mesh, so DCP writes each rank's
    columns under the row's logical key."""
    from torch.distributed.tensor import DTensor, Shard

    if isinstance(t, DTensor):
        (pl,) = t.placements
        assert isinstance(pl, Shard) and pl.dim > 0, t.placements
        return DTensor.from_local(t.to_local()[j].clone(), t.device_mesh, [Shard(pl.dim - 1)],
                                  run_check=False)
    return t[j].clone()


def _set_row(t: torch.Tensor, j: int, row: torch.Tensor) -> None:
    to_local = getattr(t, "to_local", None)
    if to_local is not None:
        to_local()[j].copy_(row.to_local())  # type: ignore[attr-defined]
    else:
        t[j].copy_(row)


def _resharded(model: nn.Module) -> None:
    """ZeRO-3: put every FSDP2 module back to its sharded parameters. FSDP2 keeps the root's
    parameters gathered after a forward without backward (an evaluation), as plain tensors in
    a buffer it frees later: DCP must see the DTensor shards (not collective)."""
    from torch.distributed.fsdp import FSDPModule

    for m in model.modules():
        if isinstance(m, FSDPModule):
            m.reshard()


def _state(model: MoETransformer, optim: torch.optim.Optimizer | None, load: bool = False
           ) -> dict[str, torch.Tensor]:
    _resharded(model)
    rows = _expert_rows(model)
    sd: dict[str, torch.Tensor] = {}
    params = dict(model.named_parameters())
    kinds = ("exp_avg", "exp_avg_sq")
    for name, p in params.items():
        st = optim.state.get(p, {}) if optim is not None else {}
        w = _weights(p, st, load)
        if name in rows:
            for j, e in rows[name]:
                if w is not None:
                    sd[f"model.{name}.{e}"] = _row(w, j)
                for k in kinds:
                    if k in st:
                        sd[f"optim.{k}.{name}.{e}"] = _row(st[k], j)
        else:
            if w is not None:
                sd[f"model.{name}"] = w
            for k in kinds:
                if k in st:
                    sd[f"optim.{k}.{name}"] = st[k]
        if "step" in st:
            sd[f"optim.step.{name}"] = torch.as_tensor(st["step"], dtype=torch.float32).clone()
    for name, b in model.named_buffers():
        if name.endswith("expert2slot") or name not in model.state_dict():
            continue  # placement lives in meta.json; non-persistent buffers are recomputed
        sd[f"buffer.{name}"] = b
    return sd


def _owns(optim, p: nn.Parameter) -> bool:
    """Whether this rank keeps p's optimizer state (ZeRO: its owner only; else every rank)."""
    owns = getattr(optim, "owns", None)
    return owns is None or owns(p)


def list_complete(ckpt_root: Path) -> list[Path]:
    if not ckpt_root.is_dir():
        return []
    return sorted(p for p in ckpt_root.iterdir() if p.is_dir() and _STEP_RE.match(p.name))


def find_latest(ckpt_root: Path) -> Path | None:
    done = [p for p in list_complete(ckpt_root) if (p / "meta.json").is_file()]
    return done[-1] if done else None


def save_checkpoint(root: str | Path, step: int, model: MoETransformer,
                    optim: torch.optim.Optimizer,
                    meta: dict[str, Any], keep: int = 2, layer_state: dict[str, Any] | None = None,
                    _before_commit=None) -> Path:
    """Collective: every rank calls it. Returns the committed checkpoint folder.

    `layer_state` ({MoE layer name: JSON-able}, e.g. the migration monitor's window) is gathered
    from every rank and stored in meta.json under "layer_state".
    `_before_commit(tmp_path)` is a fault-injection hook for tests (called on rank 0 after the
    shards are written, before the commit rename).
    """
    root = Path(root)
    rank = dist.get_rank() if dist.is_initialized() else 0
    final = root / f"step_{step:08d}"
    tmp = root / f"step_{step:08d}.tmp"
    if rank == 0:
        root.mkdir(parents=True, exist_ok=True)
        for stale in root.glob("step_*.tmp"):  # leftovers of a killed save
            shutil.rmtree(stale, ignore_errors=True)
        if final.exists():
            shutil.rmtree(final)
        tmp.mkdir()
    _barrier()
    with warnings.catch_warnings():  # single-process runs are intended, not a misconfiguration
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.save(_state(model, optim), checkpoint_id=str(tmp))
    # each pipeline stage knows only its own layers' placement: gather them all for meta.json
    # without replicas: expert2slot [E]; with redundant slots: {"slots": slot2expert [n_slots]}
    placement = {name: {"slots": layer.slot_map().tolist()} if layer.replicated
                 else layer.expert2slot.tolist() for name, layer in named_moe_layers(model).items()}
    layer_state = dict(layer_state or {})
    if dist.is_initialized() and dist.get_world_size() > 1:
        parts: list[tuple[dict, dict]] = [({}, {}) for _ in range(dist.get_world_size())]
        dist.all_gather_object(parts, (placement, layer_state))
        placement = {k: v for part, _ in parts for k, v in part.items()}
        layer_state = {k: v for _, part in parts for k, v in part.items()}
    _barrier()
    if rank == 0:
        meta = dict(meta, step=step, placement=dict(sorted(placement.items())),
                    layer_state=layer_state)
        if _before_commit is not None:
            _before_commit(tmp)
        _write_atomic(tmp / "meta.json", json.dumps(meta, indent=1))
        os.replace(tmp, final)
        _write_atomic(root / "latest", final.name + "\n")
        for old in list_complete(root)[:-keep] if keep > 0 else []:
            shutil.rmtree(old, ignore_errors=True)
        _fsync_dir(root)
    _barrier()
    return final


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".part")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def read_meta(path: Path) -> dict[str, Any]:
    meta_file = path / "meta.json"
    if not path.is_dir():
        raise CheckpointError(f"checkpoint {str(path)!r} does not exist")
    if not meta_file.is_file() or not (path / ".metadata").is_file():
        raise CheckpointError(
            f"checkpoint {str(path)!r} is incomplete (missing meta.json or .metadata): it was "
            f"probably interrupted while being written; complete checkpoints next to it: "
            f"{[p.name for p in list_complete(path.parent) if (p / 'meta.json').is_file()]}")
    try:
        return json.loads(meta_file.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"checkpoint {str(path)!r} has a corrupt meta.json: {e}") from None


def check_same_model(path: Path, meta: dict[str, Any], expect: dict[str, Any]) -> None:
    """Raise CheckpointError naming the differing model fields (values present on both sides first)."""
    saved = meta.get("model") or {}
    if saved == expect:
        return
    both = sorted(k for k in set(saved) & set(expect) if saved[k] != expect[k])
    only = sorted(set(saved) ^ set(expect))
    parts = [f"{k} (checkpoint {saved[k]!r}, run {expect[k]!r})" for k in both]
    if only:
        parts.append(f"{len(only)} fields present on one side only (e.g. {only[:3]})")
    raise CheckpointError(f"checkpoint {str(path)!r} belongs to another model: fields differ: "
                          + ", ".join(parts[:8]))


def restore_placement(path: Path, name: str, layer: MoELayer, saved: Any, saved_ep: int) -> None:
    """Set MoE layer `name`'s placement from checkpoint `path`'s record of it (`saved`: the
    expert2slot list, or {"slots": slot2expert} with redundant slots, for `saved_ep` EP ranks),
    checked first (CheckpointError naming what is wrong), where it fits this run; weights load
    by logical expert, so a run with another number of redundant slots keeps its own initial
    map instead. `load_checkpoint` calls it for every MoE layer before reading expert rows."""
    E = layer.num_experts
    if isinstance(saved, dict) and "slots" in saved:  # a run with redundant slots
        from balance.replicas import check_slot_map

        slots = saved["slots"]
        try:
            check_slot_map(slots, E, saved_ep, len(slots) // saved_ep,
                           f"checkpoint {str(path)!r} placement of {name!r}")
        except ValueError as e:
            raise CheckpointError(str(e)) from None
        if layer.replicated and len(slots) == layer.n_slots and \
                saved_ep == layer.dispatcher.ep:
            layer.set_slots(slots)
        return
    if saved is None or len(saved) != E:
        raise CheckpointError(f"checkpoint {str(path)!r}: no placement of {E} experts for "
                              f"{name!r}; it is from another model")
    if sorted(saved) != list(range(E)):
        raise CheckpointError(f"checkpoint {str(path)!r}: placement of {name!r} {saved} is not "
                              f"a permutation of 0..{E - 1} (expert -> slot)")
    if not layer.replicated:  # expert2slot [E] -> the slot map
        slots = [0] * E
        for expert, g in enumerate(saved):
            slots[g] = expert
        layer.set_slots(slots)


def load_checkpoint(path: str | Path, model: MoETransformer, optim: torch.optim.Optimizer,
                    expect_model: dict[str, Any] | None = None,
                    placement: dict[str, Any] | None = None) -> dict[str, Any]:
    """Collective. Restores placement, weights and optimizer state in place; returns meta.

    `placement` ({layer name: expert2slot or {"slots": slot2expert}} for THIS run's EP size,
    e.g. `trainer.elastic.remap_placement` after a change of EP size) replaces the saved
    placement of the layers it names, before their expert rows are read."""
    path = Path(path)
    meta = read_meta(path)
    if expect_model is not None:
        check_same_model(path, meta, expect_model)
    layers = named_moe_layers(model)
    saved = meta.get("placement", {})
    saved_ep = int((meta.get("mesh") or {}).get("ep", 1))
    placement = placement or {}
    for name, layer in layers.items():  # this rank's MoE layers (one pipeline stage's under PP)
        if name in placement:
            restore_placement(path, name, layer, placement[name],
                               getattr(layer.dispatcher, "ep", 1))
        else:
            restore_placement(path, name, layer, saved.get(name), saved_ep)
    # AdamW state must exist before DCP can load into it (under ZeRO: the owned parameters')
    for p in model.parameters():
        if not _owns(optim, p):
            continue
        st = optim.state[p]
        if "exp_avg" not in st:
            st["step"] = torch.zeros((), dtype=torch.float32)
            st["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            st["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
    sd = _state(model, optim, load=True)
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            dcp.load(sd, checkpoint_id=str(path))
    except (Exception, CheckpointException) as err:  # DCP's CheckpointException: BaseException
        raise CheckpointError(f"checkpoint {str(path)!r} could not be read ({type(err).__name__}: "
                              f"{str(err).splitlines()[0] if str(err) else ''}); it is corrupt or "
                              f"from another model") from None
    rows = _expert_rows(model)
    params = dict(model.named_parameters())
    for name, p in params.items():
        owned = _owns(optim, p)  # under ZeRO the weights load everywhere, the state on owners
        master = optim.state[p].get("master") if owned else None
        if name in rows:
            for j, e in rows[name]:
                row = sd[f"model.{name}.{e}"]
                _set_row(p.data, j, row)  # bf16 weights: rounded from the fp32 value
                if master is not None:
                    master[j].copy_(row)
                for k in ("exp_avg", "exp_avg_sq"):
                    if owned:
                        _set_row(optim.state[p][k], j, sd[f"optim.{k}.{name}.{e}"])
        elif has_main_grad(p):  # the fp32 value (master or buffer) -> the bf16 weight
            p.data.copy_(sd[f"model.{name}"])
        if owned:
            optim.state[p]["step"] = sd[f"optim.step.{name}"].clone()
    return meta
