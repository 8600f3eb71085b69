"""Choosing which committed copy to restore, and loading it into the providers.

Tiers are ordered fastest first, so the first tier that holds the wanted step and reads back clean
wins. A copy whose manifest is invalid or whose bytes fail their checksums is skipped (logged) in
favour of the same step on a slower tier; bad data is never handed to a provider.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from tierstate.errors import TierstateError

from ..providers.base import ReadState
from ..providers.composite import CompositeProvider
from ..tiers.filesystem import FilesystemTier
from ..tiers.format import Manifest
from ..tiers.locks import reading
from ..tiers.reader import COPY_ERRORS, read_items

log = logging.getLogger("tierstate")


CopyReader = Callable[[Path, Manifest, list[str]], Mapping[str, Any]]
"""Reads the given items of one committed copy: (its directory, its manifest, item keys) -> state
(a :class:`~providers.base.ReadState` where it can tell the providers which tensors are fresh)."""


class NoCheckpointError(TierstateError, FileNotFoundError):
    """No tier holds a committed, readable checkpoint for the requested step."""


@dataclass(frozen=True)
class RestoreResult:
    step: int
    tier: str
    path: Path
    bytes_read: int
    seconds: float
    problems: tuple[str, ...] = ()  # the copies skipped on the way, each naming step, tier, file and frame


def resolve_step(tiers: list[FilesystemTier], which: int | str) -> int:
    if which == "latest":
        steps = [s for tier in tiers for s in tier.steps()]
        if not steps:
            where = ", ".join(f"{t.name}={t.root}" for t in tiers)
            raise NoCheckpointError(f"no committed checkpoint on any tier ({where})")
        return max(steps)
    if isinstance(which, bool) or not isinstance(which, int) or which < 0:
        raise ValueError(f"restore target must be 'latest' or a step number >= 0, got {which!r}")
    return which


def fresh_read(state: dict[str, Any]) -> ReadState:
    """A state just read into buffers of its own (:func:`read_items`), as the providers receive it: every
    tensor fresh, except those sharing storage with another item (tied weights), which a keeping
    provider must still copy, and empty ones, whose storages cannot be told apart."""
    storages: dict[int, int] = {}
    tensors = {key: v for key, v in state.items() if isinstance(v, torch.Tensor)}
    for tensor in tensors.values():
        ptr = tensor.untyped_storage().data_ptr()
        storages[ptr] = storages.get(ptr, 0) + 1
    fresh = {key for key, t in tensors.items() if t.numel() and storages[t.untyped_storage().data_ptr()] == 1}
    return ReadState(state, fresh)


def restore_into(
    provider: CompositeProvider,
    tiers: list[FilesystemTier],
    which: int | str,
    allow_pickle: bool,
    fallback: bool = False,
    read: CopyReader | None = None,
) -> RestoreResult:
    """Restore ``which`` into ``provider``'s children; only their items are read.

    ``read`` reads one copy (by default this process reads all of it); with many ranks it is a
    collective that every rank enters for the same copy and that fails on all of them alike.

    Another tier's copy of the same step is always tried, since it holds the same verified bytes.
    An older step is tried only with ``fallback``, because it silently loses training progress
    otherwise; every copy skipped is logged and listed in the result's ``problems``.
    """
    if read is None:

        def read(directory: Path, manifest: Manifest, keys: list[str]) -> Mapping[str, Any]:
            return fresh_read(read_items(directory, manifest, keys, allow_pickle=allow_pickle))

    wanted = resolve_step(tiers, which)
    candidates = [wanted]
    if fallback:
        candidates += sorted({s for tier in tiers for s in tier.steps() if s < wanted}, reverse=True)
    problems: list[str] = []
    for step in candidates:
        for tier in tiers:
            if step not in tier.steps():
                continue
            started = time.perf_counter()
            try:
                with reading(tier.step_dir(step)):  # retention cannot delete it while it is being read
                    manifest = tier.manifest(step)
                    keys = [k for k in manifest.items if k.split("/", 1)[0] in provider.children]
                    state = read(tier.step_dir(step), manifest, keys)
            except COPY_ERRORS as exc:
                log.warning("restore step %d: copy on tier %s is unusable: %s", step, tier.name, exc)
                problems.append(f"step {step} on tier {tier.name}: {exc}")
                continue
            if step != wanted:
                log.warning("restore: step %d is unusable, fell back to step %d", wanted, step)
            provider.restore(state)
            seconds = time.perf_counter() - started
            return RestoreResult(step, tier.name, tier.step_dir(step), manifest.raw_bytes, seconds, tuple(problems))
    detail = "; ".join(problems) if problems else "no tier holds it"
    older = " or any older step" if fallback else ""
    raise NoCheckpointError(f"cannot restore step {wanted}{older}: {detail}")
