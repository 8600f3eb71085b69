"""Hugging Face ``Trainer``: ``Trainer(..., callbacks=[TierstateCallback(every=500)])``.

``trainer.train()`` then checkpoints every ``every`` optimizer steps through tierstate, and, when the
tiers hold a checkpoint written by this callback, resumes from the newest one the way
``trainer.train(resume_from_checkpoint=...)`` resumes from a directory of its own.

This module imports nothing of transformers: ``TierstateCallback`` (a ``TrainerCallback``, in
:mod:`tierstate.integrations.hf_trainer`) is loaded on first use, with transformers, so that
``import tierstate`` and ``import tierstate.integrations.hf`` stay free of it; without transformers it
says to ``pip install 'tierstate[hf]'``.
"""

from __future__ import annotations

from importlib import import_module
from typing import TYPE_CHECKING, Any

from . import needs_extra

if TYPE_CHECKING:
    from .hf_trainer import TierstateCallback

__all__ = ["TierstateCallback"]


def __getattr__(name: str) -> Any:
    """``TierstateCallback``, imported (with transformers) the first time it is asked for."""
    if name != "TierstateCallback":
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    with needs_extra("hf", "TierstateCallback", ("transformers", "accelerate")):
        value = import_module("tierstate.integrations.hf_trainer").TierstateCallback
    globals()[name] = value
    return value
