"""fb's memory for a run's --comm.a2a_overlap=auto, asked by train.py at start-up.

The trainer decides `auto` (`trainer.build.resolve_a2a`, the rule `trainer.layout.auto_overlap`)
but sits below the planner in the import graph, so train.py hands it `fb_memory_of_run`: the
planner's memory model (`tuner.estimate.fb_memory`) of the run's layout with fb's in-flight
micro-batches, priced as `python -m tuner estimate` prices train.py (the "trainer" precision
policy of the run's backend and dtypes, train.py's per-parameter ZeRO sharding, the trainer's
activation set on CPU where it is derived, else the published one).
"""

from __future__ import annotations

from model import ModelConfig
from trainer.config import RunConfig
from trainer.layout import Layout
from tuner.counts import trainer_act_supported
from tuner.estimate import fb_memory
from tuner.layout import Assumptions, ParallelPlan, trainer_precision

__all__ = ["fb_memory_of_run"]


def fb_memory_of_run(run: RunConfig, mcfg: ModelConfig, layout: Layout,
                     backend: str) -> tuple[float, float]:
    """(peak bytes, extra activation bytes) of the busiest rank of `run` on `layout` with --comm.a2a_overlap=fb; a ValueError where
    the planner cannot model the run."""
    par, t = run.parallel, run.train
    plan = ParallelPlan(
        pp=layout.pp, ep=layout.ep, dp=layout.dp, microbatches=par.microbatches,
        global_batch=t.global_batch, seq_len=t.seq_len,
        schedule=par.schedule if layout.pp > 1 else "1f1b", n_virtual=layout.vpp,
        checkpointing=t.checkpointing, ep_placement=layout.placement, zero=par.zero,
        redundant=run.balance.redundant, tp=layout.tp, a2a_overlap="fb")
    cpu = backend == "gloo"
    asm = Assumptions(activation_set="trainer" if cpu and trainer_act_supported(mcfg)
                      else "published", zero_sharding="per-parameter")
    return fb_memory(mcfg, plan, trainer_precision(backend, t.param_dtype, t.reduce_dtype), asm)
