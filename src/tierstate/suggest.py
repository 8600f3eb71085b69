""""Did you mean": the one wording of a guess at what a mistyped name meant, for every message that makes one
(config keys, CLI commands, options, s3 actions, packaged config names, tier names).

Beside the facade, importing nothing but difflib, so that the CLI's parser (which answers ``--help``
without loading torch) and the config loader share it.
"""

from __future__ import annotations

import difflib
from collections.abc import Iterable


def closest(word: str, candidates: Iterable[str]) -> str | None:
    """The candidate ``word`` is most probably a misspelling of, if one is close enough."""
    close = difflib.get_close_matches(word, list(candidates), n=1, cutoff=0.6)
    return close[0] if close else None


def did_you_mean(word: str, candidates: Iterable[str]) -> str:
    """``; did you mean 'x'?`` for the closest candidate, or nothing when none is close."""
    close = closest(word, candidates)
    return f"; did you mean {close!r}?" if close else ""
