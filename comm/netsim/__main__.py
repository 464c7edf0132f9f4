"""`python -m comm.netsim`: see `comm.netsim.cli`."""

from __future__ import annotations

from comm.netsim.cli import main

raise SystemExit(main())
