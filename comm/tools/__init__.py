"""comm.tools: running and measuring the exchanges on one machine or an emulated cluster.

    spawn.py      run_local: the one launcher of local process groups
    calibrate.py  fit the `auto` cost model on the running job
    emulate.py    the namespace-emulated multi-node cluster (`python -m comm.emulate`)
    selfcheck.py  flat / HALO / auto exact on a real cluster (`python -m comm.selfcheck`)
"""
