"""Integrations with training frameworks (Hugging Face, Lightning, PyTorch DCP).

Each module imports its framework lazily, inside the functions and classes that need it, so that
``import tierstate`` never pulls in a framework; the framework itself installs with an extra
(``pip install 'tierstate[hf]'``, ``'tierstate[lightning]'``). Used without it, an integration says
which extra to install (:func:`needs_extra`), not a bare ``ModuleNotFoundError``.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from tierstate.errors import TierstateError


class MissingExtraError(TierstateError, ModuleNotFoundError):
    """An integration was used without the framework it integrates; the message names the extra to install."""


@contextmanager
def needs_extra(extra: str, what: str, frameworks: tuple[str, ...]) -> Iterator[None]:
    """Around the import of ``frameworks`` for ``what``: a framework missing is a MissingExtraError naming
    ``pip install 'tierstate[EXTRA]'``. Another module missing (a framework's own dependency) is left as it is."""
    try:
        yield
    except ModuleNotFoundError as exc:
        missing = (exc.name or "").split(".")[0]
        if missing not in frameworks:
            raise
        raise MissingExtraError(
            f"{what} needs {missing}, which is not installed: pip install 'tierstate[{extra}]'", name=exc.name
        ) from None
