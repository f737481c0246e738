"""``python -m freqopt``: the freqopt command line (freqopt.cli.main), for where the ``freqopt`` script is not on
PATH."""

import sys

from freqopt.cli import main

sys.exit(main())
