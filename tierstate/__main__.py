"""``python -m tierstate``: the ``tierstate`` command without an installed entry point."""

import sys

from tierstate.tiers.cli import main

sys.exit(main())
