"""``python -m tierstate``: the ``tierstate`` command without an installed entry point."""

import sys

from tierstate.cli import main

sys.exit(main())
