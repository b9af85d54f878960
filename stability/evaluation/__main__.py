"""``python -m stability.evaluation``."""

from __future__ import annotations

import sys

from stability.evaluation import main

sys.exit(main(sys.argv[1:]))
