"""trainer.observe: what a run reports about itself (rows, statistics, traces, summaries).

    metrics    per-MoE-layer statistics gathered over the pipeline stages; the sinks
               (TensorBoard / W&B)
    stats      per-step collection: tokens per expert, router entropy, EP imbalance, exchange
               time, memory
    console    what rank 0 writes after each step (metrics.jsonl, counts.jsonl, the sinks)
    report     the summary of a run from its metrics.jsonl (`python -m trainer.report`, whose
               entry stays at trainer/report.py)
    profiling  --train.profile_steps: torch.profiler traces per rank
    memory     per-rank memory accounting on any device (state bytes, saved tensors, RSS)

It sits above trainer.distributed (stats reads the mesh) and trainer.checkpoint (stats names
the MoE layers through it); the modules that compose a run (build, step, loop) use it.
Order declared in tests/test_import_graph.py (SUBLAYERS).
"""
