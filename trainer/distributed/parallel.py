"""Apply expert parallelism to a rank-agnostic `model.MoETransformer` (gradient averaging over
the replica groups: trainer/distributed/grad_sync.py).

Order of application (fixed):
  1. every rank builds the full model from the same seed (so initial weights equal a 1-process run),
  2. each MoE layer keeps only the expert slots of its EP rank: slots [ep_idx*E_l, (ep_idx+1)*E_l)
     of the global slot space (slot g holds logical expert slot_map()[g]),
  3. its dispatcher is replaced by a `comm.ep.EPDispatcher` over the mesh's EP group.

Shape legend: E experts (global slots), E_l = E / ep local slots.
"""

from __future__ import annotations

from torch import nn

from comm.ep import EPDispatcher
from model import MoETransformer

from .mesh import Mesh

__all__ = ["parallelize", "is_expert_param"]


def is_expert_param(name: str) -> bool:
    return ".experts." in name or name.startswith("experts.")


def parallelize(model: MoETransformer, mesh: Mesh, alltoall: str = "flat", topology=None,
                cost_model=None, redundant: int = 0, overlap: str = "none",
                chunks: int = 1) -> MoETransformer:
    """Shard the experts of every MoE layer over the mesh's EP group (in place); with
    `redundant` = r > 0 every EP rank hosts E / ep + r slots (trainer/distributed/replicas.py)."""
    if mesh.ep == 1:
        return model
    from .replicas import initial_slot_map

    for layer in model.moe_layers():
        if redundant:
            layer.resize_slots(initial_slot_map(layer.num_experts, mesh.ep, redundant))
        disp = EPDispatcher(mesh.ep_group, mesh.ep, layer.n_slots, alltoall,
                            topology, cost_model, overlap, chunks)
        shard_layer(layer, disp, mesh.ep_idx)
    return model


def shard_layer(layer, disp: EPDispatcher, ep_idx: int) -> None:
    """Keep EP rank `ep_idx`'s slots of one MoE layer's experts (slots ep_idx * local ...) and
    route the layer through `disp` (in place)."""
    local = disp.local
    lo = ep_idx * local
    ex = layer.experts
    for name in ("w1", "w2", "w3"):
        full = getattr(ex, name)
        setattr(ex, name, nn.Parameter(full.detach()[lo:lo + local].clone()))
    ex.first_slot = lo
    layer.dispatcher = disp
