"""The ``tierstate`` command line (also ``python -m tierstate``): all of its parsing and all of its output.

One package at the top of the stack, beside the facade, because it uses every layer: the config
loader of pipeline/ (tiers are read exactly as the runner reads them), the commands of tiers/ (which
take tier objects, return data and never print) and the DCP integration (import, export). Nothing
below imports it, so no package imports upward. Its modules:

- ``parser``: options, help, "did you mean"; needs nothing but argparse, so ``--help`` and
  ``--version`` (and a bare ``tierstate``: the help) answer at once.
- ``run``: a parsed command line run (imports the checkpoint code, and torch, only now).
- ``options``: tiers from ``--config`` and ``--tier``, and option values (sizes, durations, choices).
- ``render``: results as plain lines, tables or JSON; ``stats``: what a checkpoint cost;
  ``progress``: byte bars on stderr.

Exit codes: 0 done, 1 some checkpoint failed (each named), 2 bad input (the option, key or path
named), 130 interrupted (Ctrl-C), 141 the reader of stdout went away (``tierstate ls | head``).
"""

from __future__ import annotations

import os
import sys

from .parser import build_parser, parse


def main(argv: list[str] | None = None) -> int:
    """Run the ``tierstate`` command line ``argv`` (default: the process's); its exit code. Nothing at all
    asks for the help, as a bare ``git`` or ``docker`` does."""
    argv = sys.argv[1:] if argv is None else argv
    if not argv:
        build_parser().print_help()
        return 0
    args = parse(argv)
    try:
        from .run import run  # the checkpoint code, and torch: only now that a command is to run

        code = run(args)
        sys.stdout.flush()  # a closed pipe shows here, not at exit where it would print a traceback
        return code
    except KeyboardInterrupt:
        print(f"tierstate {args.command}: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        # The reader stopped reading (``| head``): what is left unsaid has no one to read it. Point
        # stdout at /dev/null so that Python's flush at exit does not fail again, and say nothing.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141
