"""``python -m freqopt.cli``: the freqopt command line (also how DeepSpeed's launcher starts each rank)."""

import sys

from freqopt.cli import main

sys.exit(main())
