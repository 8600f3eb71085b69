"""The root of every error tierstate raises on purpose.

It lives beside the facade, outside ``pipeline``, ``providers`` and ``tiers``, so that all three can
derive from it without importing one another. Each concrete error also keeps the builtin base it had
(``OSError`` for storage, ``ValueError`` for bad input), so code that catches those still works.
"""


class TierstateError(Exception):
    """Base class of every error tierstate raises on purpose: ``except TierstateError`` catches them all."""


class UsageError(TierstateError):
    """A request the tiers cannot serve as asked (no such tier or step, options that contradict):
    the CLI prints it without a traceback, exit code 2."""
