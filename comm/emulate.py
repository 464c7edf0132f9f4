"""`python -m comm.emulate`: the command line of `comm.tools.emulate` (see there)."""

from __future__ import annotations

import sys

from comm.tools.emulate import main

if __name__ == "__main__":
    sys.exit(main())
