"""ZeRO-3: parameters sharded over their replica groups with FSDP2 (`fully_shard`).

Each parameter is split evenly over the ranks of its replica group (trainer/distributed/mesh.py) and
gathered per layer just before use, freed after, in the forward and again in the backward:

    dense parameters   over the stage group (dp x ep ranks): one FSDP group per block
                       (attention, norms, dense or shared FFN), its router apart (below), and
                       the root (embedding, final norm, lm_head); dim 0 sharded
    expert parameters  over the dp group: one FSDP group per MoE layer's `experts`, sharded on
                       dim 1 (D of w1/w3 [E_l, D, F], F of w2 [E_l, F, D]), so every rank keeps
                       all E_l rows (slots) of its shard: an expert migration between EP ranks
                       moves the same columns of a row between ranks of the same dp index, and
                       the AdamW rows with it, exactly as at ZeRO-0 (`balance.migrate` gets the
                       local shards, trainer/balancing.py)

Order (fixed, every rank the same): experts, router, block for each layer in order, then the
root (with a pipeline: each of this rank's stages, trainer/distributed/pipe.py); block i prefetches block i+1's gather in the forward (`set_modules_to_forward_prefetch`),
FSDP2 prefetches the previous block in the backward. The 1-D DeviceMeshes are made from the
trainer's own groups (`DeviceMesh.from_group`); a group of one rank gets a one-rank group.

Mixed precision is FSDP2's `MixedPrecisionPolicy`: the fp32 shards are the masters the AdamW
steps, gathered in `param_dtype` (bf16: 2 bytes per element on the wire), gradients
reduce-scattered in `reduce_dtype` and kept as fp32 shards. The router is its own FSDP group
gathered in fp32 (model/router.py computes in fp32; `route` is registered as a forward method).

Gradient scale: FSDP2 averages over the mesh it reduces on. Dense gradients want 1/(dp*ep)
(the stage group: what FSDP2 does); expert gradients are summed over the EP group by the
all-to-all and also want 1/(dp*ep), FSDP2 gives 1/dp, so `Zero3Sync.finish` multiplies them by
1/ep (FSDP2's `set_gradient_divide_factor` uses PREMUL_SUM, which gloo does not have).

Checkpoints stay layout-free: DCP writes each DTensor's shards under the same logical keys
(trainer/checkpoint.py builds one DTensor per expert row), so ZeRO-0/1/2/3 read each other's.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch import nn

from .mesh import Mesh
from .parallel import is_expert_param

__all__ = ["shard_model", "Zero3Sync", "is_dtensor", "local"]


def is_dtensor(t) -> bool:
    from torch.distributed.tensor import DTensor

    return isinstance(t, DTensor)


def local(t: torch.Tensor) -> torch.Tensor:
    """This rank's shard of a DTensor (a view: in-place writes reach the parameter), else t."""
    return t.to_local() if is_dtensor(t) else t  # type: ignore[attr-defined]


def _meshes(mesh: Mesh, device_type: str):
    """1-D DeviceMeshes over the stage group (dense) and the dp group (experts)."""
    from torch.distributed.device_mesh import DeviceMesh

    groups = {"dense": mesh.stage_group, "expert": mesh.dp_group}
    singles = None
    if any(g is None for g in groups.values()):  # every rank creates every one-rank group
        singles = [dist.new_group([r]) for r in range(dist.get_world_size())]
    out = {}
    for kind, g in groups.items():
        pg = g if g is not None else singles[dist.get_rank()]  # type: ignore[index]
        out[kind] = DeviceMesh.from_group(pg, device_type)
    return out


def _expert_placement(n: int):
    """Shard expert stacks on dim 1 (keep every slot row on every rank of the dp group)."""
    from torch.distributed.tensor import Shard

    def place(p: nn.Parameter):
        for dim in (1, 2):
            if p.shape[dim] % n == 0:
                return Shard(dim)
        raise ValueError(f"parallel.zero=3: an expert weight of shape {list(p.shape)} cannot be "
                         f"split evenly over the dp={n} ranks on dim 1 or 2 (d_model, "
                         f"moe_ffn_dim); choose dims divisible by {n}")
    return place


def shard_model(model: nn.Module, mesh: Mesh, precision, device_type: str,
                roots: list[nn.Module] | None = None) -> list[nn.Module]:
    """Apply FSDP2 to `model` (materialised, fp32) in the order of the module docstring;
    returns the FSDP modules, blocks in layer order, then the root(s). `roots`: with a
    pipeline, this rank's stage modules (trainer/distributed/pipe.py `Stage`, what the schedule calls)
    become the roots in place of the model (embedding / norm / head in their stage)."""
    from torch.distributed.fsdp import (
        MixedPrecisionPolicy,
        fully_shard,
        register_fsdp_forward_method,
    )

    from model.moe import MoELayer
    from model.transformer import Block

    meshes = _meshes(mesh, device_type)
    low = precision.param if precision.param != torch.float32 else None
    mp = MixedPrecisionPolicy(param_dtype=low, reduce_dtype=precision.reduce)
    mp32 = MixedPrecisionPolicy(param_dtype=torch.float32, reduce_dtype=torch.float32)
    layers: nn.ModuleList = model.layers  # type: ignore[assignment]
    blocks = [b for b in layers if isinstance(b, Block)]
    for b in blocks:
        if isinstance(b.ffn, MoELayer):
            fully_shard(b.ffn.experts, mesh=meshes["expert"], mp_policy=mp,
                        shard_placement_fn=_expert_placement(meshes["expert"].size()))
            fully_shard(b.ffn.router, mesh=meshes["dense"], mp_policy=mp32)
            register_fsdp_forward_method(b.ffn.router, "route")
        fully_shard(b, mesh=meshes["dense"], mp_policy=mp)
    roots = roots if roots is not None else [model]
    for root in roots:
        fully_shard(root, mesh=meshes["dense"], mp_policy=mp)
        mine = [b for b in blocks if any(b is m for m in root.modules())]
        for a, nxt in zip(mine, mine[1:], strict=False):
            a.set_modules_to_forward_prefetch([nxt])  # type: ignore[operator]
    return [*blocks, *roots]


class Zero3Sync:
    """What `GradSync` is to ZeRO-0/1/2, for FSDP2's sharded gradients: FSDP2 reduce-scatters
    each block's gradients in its backward (every micro-batch) into fp32 shards; `finish`
    applies the experts' 1/ep, `clip` takes the global norm from the local shards."""

    zero = 3
    launched_in_backward = 0

    def __init__(self, model: nn.Module, mesh: Mesh) -> None:
        self.mesh = mesh
        named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        self.dense = [p for n, p in named if not is_expert_param(n)]
        self.expert = [p for n, p in named if is_expert_param(n)]
        self.row_weights: dict = {}  # redundant slots are refused with zero=3

    def owns(self, p: nn.Parameter) -> bool:
        return True  # every rank steps its own shard of every parameter

    def start_step(self, m: int = 1) -> None:
        if m < 1:
            raise ValueError(f"m={m} micro-batches; need >= 1")

    @torch.no_grad()
    def finish(self) -> None:
        if self.mesh.ep > 1:
            for p in self.expert:
                if p.grad is not None:
                    local(p.grad).mul_(1.0 / self.mesh.ep)
        for p in self.dense + self.expert:  # a parameter that got no gradient (an idle expert)
            if p.grad is None:
                p.grad = torch.zeros_like(p)

    def broadcast_params(self) -> None:
        pass  # nothing to broadcast: each rank updated its own shard

    def clip(self, max_norm: float) -> float:
        """Global L2 norm before clipping: every gradient element lives on exactly one rank of
        a stage (dense over the stage group; experts over dp, EP ranks hold other experts), so
        one sum over the stage group (and the pp group) gives it."""
        sq = sum((local(p.grad).double().pow(2).sum() for p in self.dense + self.expert
                  if p.grad is not None), torch.zeros((), dtype=torch.float64))
        for g in (self.mesh.stage_group, self.mesh.pp_group):
            if g is not None:
                dist.all_reduce(sq, group=g)
        norm = math.sqrt(float(sq))
        if max_norm > 0 and norm > max_norm:
            coef = max_norm / (norm + 1e-6)
            for p in self.dense + self.expert:
                if p.grad is not None:
                    local(p.grad).mul_(coef)
        return norm
