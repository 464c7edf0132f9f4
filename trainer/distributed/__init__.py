"""trainer.distributed: how one run is spread over ranks (process groups, the parallelisms,
gradient synchronisation, sharded state, mixed precision).

    mesh             the run's process groups, built from a `trainer.layout.Layout`
    parallel         expert parallelism applied to a rank-agnostic model (EPDispatcher per layer)
    tensor_parallel  tensor / sequence parallel of the dense side (DTensor)
    pipe             pipeline parallel: stage split, stage modules, the aux-loss hook
    grad_sync        gradient averaging over replica groups, ZeRO-2 reduction, norm and clipping
    zero             ZeRO-1/2: sharded optimizer state and gradients
    zero3            ZeRO-3: parameters sharded with FSDP2 `fully_shard`
    precision        bf16 working weights, fp32 masters and gradients: here because the masters
                     and main grads are what grad_sync, zero, replicas and the checkpoint shard,
                     reduce and save
    replicas         redundant expert slots: the slot map at start, replica gradient sums

Left in trainer/: `layout` (the rank arithmetic, pure, also read by the planner) and `config`
stay at the package's base beneath this sub-package; `checkpoint` sits above it (it saves the
masters precision keeps); the modules that compose a run (setup, build, step, loop, elastic)
sit above all sub-packages. Order declared in tests/test_import_graph.py (SUBLAYERS).
"""
