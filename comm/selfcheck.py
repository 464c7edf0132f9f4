"""`python -m comm.selfcheck`: the command line of `comm.tools.selfcheck` (see there)."""

from __future__ import annotations

import sys

from comm.tools.selfcheck import main

if __name__ == "__main__":
    sys.exit(main())
