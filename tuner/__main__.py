"""`python -m tuner ...`: see tuner.cli."""

from __future__ import annotations

import sys

from tuner.cli import main

sys.exit(main())
