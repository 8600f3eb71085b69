"""``python -m tiers``: the ``tierstate`` command without an installed entry point."""

import sys

from tiers.cli import main

sys.exit(main())
