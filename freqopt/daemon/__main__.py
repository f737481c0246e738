"""``python -m freqopt.daemon``: freqoptd (freqopt.daemon.cli)."""

import sys

from freqopt.daemon.cli import main

sys.exit(main())
