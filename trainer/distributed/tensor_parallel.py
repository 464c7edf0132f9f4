"""Tensor parallel (and sequence parallel) of the dense side, through torch.distributed.tensor.

Applied from outside to a materialised, rank-agnostic `model.MoETransformer` (after expert
sharding and pipeline stripping), in this fixed order, on the run's 1-D TP DeviceMesh
(`Mesh.tp_mesh`: tp consecutive ranks of a stage, the fastest links):

  1. every linear of attention (GQA: wq, wk, wv; MLA: wq or wq_b, wkv_b) is split column-wise
     (by heads) and the output projection wo row-wise; each rank runs H / tp heads (the
     module's head counts are set to the local ones). MLA's low-rank down-projections
     (wq_a, wkv_a) and latent norms stay whole: their input is the gathered sequence and their
     gradients come out equal on every TP rank (the column-parallel input gradient is reduced;
     the shared RoPE key, used by every head, has its gradient summed over TP: `_SumGrad`);
  2. dense FFNs and shared experts: w1, w3 column-wise, w2 row-wise;
  3. the head: column-wise over the vocabulary, logits gathered (every TP rank computes the
     same loss; no loss parallel);
  4. with SP (`--parallel.sp=true`, the default): the residual stream between the TP regions
     is split over the sequence, [B, S/tp, D] per rank: the embedding output is sliced, the
     norms run on the slice (`SequenceParallel`), each TP region starts with an all-gather of
     the sequence and ends with a reduce-scatter (row-parallel output `Shard(1)`). Without SP
     the stream is whole on every TP rank and a region ends with an all-reduce;
  5. routed experts are not split (expert tensor parallel is not built): they stay on EP,
     whose groups span the TP ranks (parallel folding, trainer/layout.py), and every token is
     routed once: with SP each rank routes its slice; without, each rank takes its share of
     the sequence before the router and the outputs are gathered after (`SeqShards`). The
     router's per-sequence load-balancing loss sums its statistics over the TP ranks, so it
     equals the 1-process value.

Gradients (trainer/distributed/grad_sync.py asks `grad_kind`): a TP-sharded weight's gradient is its
shard's, averaged over the dense group (the stage's ranks with the same TP index, "DP only");
a replicated weight is either equal on every TP rank ("replicated": averaged over the dense
group too) or a partial sum over the TP ranks' tokens ("partial": the SP norms, the router,
GQA's per-head q/k norms, the shared-expert gate under SP; summed over the whole stage).

Shape legend: B batch, S sequence, D model, H heads, tp TP ranks.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    PrepareModuleOutput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

__all__ = ["SeqShards", "TPPlan", "apply_tensor_parallel", "grad_kind", "local",
           "tp_problems"]

GRAD_KINDS = ("sharded", "replicated", "partial")


def local(t: torch.Tensor) -> torch.Tensor:
    """The local shard of a DTensor (sharing its storage); a plain tensor as it is."""
    return t._local_tensor if isinstance(t, DTensor) else t


def tp_problems(tp: int, sp: bool, etp: int, mcfg: Any, seq_len: int, pp: int) -> list[str]:
    """Every reason the model and sequence cannot run under `tp` (each naming the numbers and
    what is valid); [] when they can. Heads are checked by `trainer.layout.layout_problems`."""
    out = []
    if isinstance(etp, bool) or etp != 1:
        out.append(f"parallel.etp={etp!r}: expert tensor parallel is not built in the trainer "
                   f"(valid: 1); experts are split over EP, whose groups may span the TP ranks "
                   f"(e.g. --parallel.ep=4 --parallel.tp=2 on 4 ranks)")
    if tp == 1:
        return out
    if mcfg.tie_embeddings:
        out.append(f"parallel.tp={tp} with tie_embeddings=True is not supported (the head is "
                   f"split over the vocabulary, the embedding is not); use tp=1 or untied "
                   f"embeddings")
    if seq_len % tp:
        out.append(f"parallel.tp={tp} needs train.seq_len divisible by tp (each TP rank "
                   f"{'holds' if sp else 'routes'} seq_len / tp tokens of every sequence); "
                   f"seq_len={seq_len}")
    if mcfg.vocab_size % tp:
        out.append(f"parallel.tp={tp} does not divide vocab_size={mcfg.vocab_size} (the head "
                   f"is split over the vocabulary)")
    for name in ("dense_ffn_dim", "shared_ffn_dim"):
        v = getattr(mcfg, name)
        if v and v % tp:
            out.append(f"parallel.tp={tp} does not divide the model's {name}={v}")
    if mcfg.attn_out_bias:
        out.append(f"parallel.tp={tp} with attn_out_bias=True is not built (a bias after the "
                   f"row-parallel output projection); use tp=1")
    return out


class SeqShards:
    """The TP ranks' pieces of each sequence (rank i holds positions [i S/tp, (i+1) S/tp)).

    `split_input`: the MoE input is whole on every TP rank (no SP), so the routed path takes
    this rank's share first (`scatter`, backward: all-gather of the gradient) and gathers the
    outputs after (`gather`, backward: this rank's slice, the downstream being the same on
    every TP rank). `sum`: the sum over the TP ranks of per-sequence partial sums (the
    router's load-balancing statistics), backward the identity (each rank's loss is the same
    copy). All three are DTensor redistributions over the TP mesh."""

    def __init__(self, tp_mesh: Any, split_input: bool) -> None:
        self.mesh, self.split_input = tp_mesh, split_input
        self.parts = tp_mesh.size()

    def scatter(self, x_BSD: torch.Tensor) -> torch.Tensor:
        d = DTensor.from_local(x_BSD, self.mesh, [Replicate()], run_check=False)
        return d.redistribute(self.mesh, [Shard(1)]).to_local()

    def gather(self, y_BsD: torch.Tensor) -> torch.Tensor:
        d = DTensor.from_local(y_BsD, self.mesh, [Shard(1)], run_check=False)
        return d.redistribute(self.mesh, [Replicate()]).to_local()

    def sum(self, t: torch.Tensor) -> torch.Tensor:
        d = DTensor.from_local(t, self.mesh, [Partial()], run_check=False)
        return d.redistribute(self.mesh, [Replicate()]).to_local()


class _SumGrad(torch.autograd.Function):
    """Identity forward; backward: the gradient summed over `group` (Megatron's "f")."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any) -> torch.Tensor:
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor, None]:
        g = g.contiguous().clone()
        dist.all_reduce(g, group=ctx.group)
        return g, None


class _SumGradOverTP:
    """MLA's shared RoPE key (`MLAttention.rope_key_grad`): whole on every TP rank and used by
    every head, so each rank's gradient covers only its H / tp heads and the TP ranks' sum is
    the gradient (one all-reduce of [B, S, qk_rope_head_dim] per layer backward)."""

    def __init__(self, group: Any) -> None:
        self.group = group

    def __call__(self, k: torch.Tensor) -> torch.Tensor:
        return _SumGrad.apply(k, self.group)


class TPPlan:
    """What `apply_tensor_parallel` did, for the gradient sync: the TP degree, SP, and the
    names of replicated parameters whose gradients are partial sums over the TP ranks."""

    def __init__(self, tp: int, sp: bool, partial: set[str]) -> None:
        self.tp, self.sp, self.partial = tp, sp, partial


def grad_kind(model: nn.Module, name: str, p: torch.Tensor) -> str:
    """"sharded", "replicated" or "partial" (module docstring) for a non-expert parameter."""
    plan: TPPlan | None = getattr(model, "tp_plan", None)
    if plan is None:
        return "replicated"
    if isinstance(p, DTensor) and any(isinstance(pl, Shard) for pl in p.placements):
        return "sharded"
    return "partial" if name in plan.partial else "replicated"


def _attention_plan(attn: Any, pre: str, seq: Any, tp_mesh: Any) -> dict[str, Any]:
    from model.attention import GQAttention

    tp = tp_mesh.size()
    rowwise = RowwiseParallel(output_layouts=seq)
    if isinstance(attn, GQAttention):
        if attn.n_kv_heads % tp or attn.n_heads % tp:
            raise ValueError(f"tp={tp} does not divide n_heads={attn.n_heads} / "
                             f"n_kv_heads={attn.n_kv_heads}")
        attn.n_heads //= tp
        attn.n_kv_heads //= tp
        # the whole sequence once per attention (all-gather under SP); kept a DTensor, so
        # the three column-parallel input gradients sum before one reduce(-scatter)
        return {pre: PrepareModuleInput(input_layouts=(seq, None),
                                        desired_input_layouts=(Replicate(), None),
                                        use_local_output=False),
                **{f"{pre}.{w}": ColwiseParallel() for w in ("wq", "wk", "wv")},
                f"{pre}.wo": rowwise}
    if attn.n_heads % tp:
        raise ValueError(f"tp={tp} does not divide n_heads={attn.n_heads}")
    attn.n_heads //= tp
    attn.rope_key_grad = _SumGradOverTP(tp_mesh.get_group())
    # MLA: wq_a / wkv_a (whole) take a plain tensor, so the gathered input is local here
    plan: dict[str, Any] = {pre: PrepareModuleInput(input_layouts=(seq, None),
                                                    desired_input_layouts=(Replicate(), None),
                                                    use_local_output=True)}
    for w in ("wq", "wq_b", "wkv_b"):
        if getattr(attn, w, None) is not None:
            plan[f"{pre}.{w}"] = ColwiseParallel()
    plan[f"{pre}.wo"] = rowwise
    return plan


def _ffn_plan(pre: str, seq: Any) -> dict[str, Any]:
    return {pre: PrepareModuleInput(input_layouts=(seq,), desired_input_layouts=(Replicate(),),
                                    use_local_output=False),
            f"{pre}.w1": ColwiseParallel(), f"{pre}.w3": ColwiseParallel(),
            f"{pre}.w2": RowwiseParallel(output_layouts=seq)}


def apply_tensor_parallel(model: Any, tp_mesh: Any, sp: bool) -> Any:
    """Split the dense side of `model` (in place) over `tp_mesh` (module docstring); the
    parameters become DTensors holding this rank's shards. Returns the model."""
    from model import MoELayer

    tp = tp_mesh.size()
    seq = Shard(1) if sp else Replicate()
    plan: dict[str, Any] = {}
    partial: set[str] = set()
    if sp and model.embed is not None:
        plan["embed"] = PrepareModuleOutput(output_layouts=Replicate(),
                                            desired_output_layouts=Shard(1))
    for i, blk in enumerate(model.layers):
        if not hasattr(blk, "attn"):  # another pipeline stage's layer
            continue
        pre = f"layers.{i}"
        if sp:
            plan[f"{pre}.attn_norm"] = SequenceParallel()
            plan[f"{pre}.ffn_norm"] = SequenceParallel()
            partial |= {f"{pre}.attn_norm.weight", f"{pre}.ffn_norm.weight"}
        plan.update(_attention_plan(blk.attn, f"{pre}.attn", seq, tp_mesh))
        for nm in ("q_norm", "k_norm"):  # GQA's per-head norms see this rank's heads only
            if getattr(blk.attn, nm, None) is not None and hasattr(blk.attn, "wk"):
                partial.add(f"{pre}.attn.{nm}.weight")
        ffn = blk.ffn
        if isinstance(ffn, MoELayer):
            shards = SeqShards(tp_mesh, split_input=not sp)
            ffn.seq_split = shards
            ffn.router.seq_split = shards
            partial.add(f"{pre}.ffn.router.weight")
            if sp:  # the layer works on its slice: a plain tensor
                plan[f"{pre}.ffn"] = PrepareModuleInput(input_layouts=(seq,),
                                                        desired_input_layouts=(seq,),
                                                        use_local_output=True)
                if ffn.shared_gate is not None:
                    partial.add(f"{pre}.ffn.shared_gate.weight")
            if ffn.shared_experts is not None:
                plan.update(_ffn_plan(f"{pre}.ffn.shared_experts", seq))
        else:
            plan.update(_ffn_plan(f"{pre}.ffn", seq))
    if model.norm is not None and model.lm_head is not None:
        if sp:
            plan["norm"] = SequenceParallel()
            partial.add("norm.weight")
        plan["lm_head"] = ColwiseParallel(input_layouts=seq, output_layouts=Replicate())
    parallelize_module(model, tp_mesh, plan)
    model.tp_plan = TPPlan(tp, sp, partial)
    return model
