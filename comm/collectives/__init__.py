"""comm.collectives: the all-to-all exchanges.

    alltoall.py   all_to_all / plan_all_to_all: flat, HALO or auto per call
    flat.py       the vendor collective, and the small exchanges of ints
    halo_plan.py  HALO's pure plan (which rows move where in each phase)
    halo.py       HALO's executor
    overlap.py    start an exchange now, wait for it later (differentiable)
    dedup.py      the deduplicated dispatch's index algebra and planning exchange
Import what you need from the modules (or from `comm`); this file imports nothing, so that
`comm.cost` and `comm.tools` can sit around it without a circle.
"""
