"""`python -m trainer.data prepare ...`: see trainer.data.prepare."""

from __future__ import annotations

import sys

from .prepare import main

if __name__ == "__main__":
    sys.exit(main())
