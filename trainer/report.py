"""`python -m trainer.report`: the command line of `trainer.observe.report` (see there)."""

from __future__ import annotations

import sys

from trainer.observe.report import main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
