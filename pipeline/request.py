"""A checkpoint request prepared on the trainer's thread, in one place: what the job is handed.

At ``checkpoint(step)`` the trainer's thread lists the state (a reused plan checked in C loops, or every
provider described and planned: plan_cache.py, plan.py), copies what may not be captured lazily
(laziness.py), records a CUDA event to copy GPU tensors as of this moment, and arms what must hold once
the lazy copies are done before the optimizer may step: the version tripwire on tensors declared
``never``/``guarded`` and, under ``policies.check_capture``, the fingerprints of every lazy tensor.
Everything else happens in the background (job.py).
"""

from __future__ import annotations

import numbers
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from tierstate.errors import TierstateError

from ..providers.base import StateProvider, shown
from ..providers.items import TensorItem
from ..tiers.format.strict import MAX_BYTES
from ..tiers.storage.filesystem import CheckpointExistsError, FilesystemTier
from .laziness import CaptureRules, EagerSnapshot, VersionWatch, changed_keys, fingerprints
from .plan import CheckpointPlan, plan_checkpoint
from .plan_cache import PlanCache, Resolve
from .stages.capture import record_ready_event
from .units import EagerSources


class CaptureChangedError(TierstateError, RuntimeError):
    """``policies.check_capture`` saw a lazily captured tensor change before its copy; names the keys."""


class NothingRegisteredError(TierstateError, RuntimeError):
    """A checkpoint was requested before anything was registered: it would hold nothing to restore."""


class InvalidStepError(TierstateError, ValueError):
    """A checkpoint step that is not a whole number from 0 to 2**50."""


def _whole_step(step: object) -> int:
    """``step`` as an int; InvalidStepError saying what was given instead (a tensor, -1, 1.5, True)."""
    if isinstance(step, numbers.Integral) and not isinstance(step, bool) and 0 <= int(step) <= MAX_BYTES:
        return int(step)
    if isinstance(step, torch.Tensor):
        raise InvalidStepError(f"checkpoint step must be an int, got a tensor ({step!r}); pass int(step)")
    if isinstance(step, numbers.Integral) and not isinstance(step, bool):
        raise InvalidStepError(f"checkpoint step must be from 0 to 2**50, got {int(step)}")
    raise InvalidStepError(f"checkpoint step must be an int from 0 to 2**50, got {type(step).__name__} {step!r}")


def checked_step(step: object, tier: FilesystemTier, many_ranks: bool, registered: bool) -> int:
    """``step`` as an int, or the error raised at the call, before anything is written: a step that is not a
    whole number from 0 to 2**50 (InvalidStepError), one the persist ``tier`` holds already
    (CheckpointExistsError), nothing ``registered`` (NothingRegisteredError)."""
    step = _whole_step(step)
    # Decided from what every rank sees alike: one process, or a persist tier all ranks share (on node-scoped
    # tiers nodes may differ, and the commit refuses it collectively instead).
    if (not many_ranks or tier.scope == "shared") and os.path.lexists(tier.step_dir(step)):
        raise CheckpointExistsError(
            f"checkpoint step {step}: tier {tier.name} holds step {step} already ({tier.step_dir(step)}); "
            "checkpoint another step, or runner.start_fresh(set_aside=True) to begin a new run"
        )
    if not registered:
        raise NothingRegisteredError(
            f"checkpoint step {step}: nothing is registered; call runner.register(model=model, optim=opt) first"
        )
    return step


@dataclass
class Request:
    """What the job writes and how its capture ends: ``plan`` (or what makes it in the background),
    ``ready`` (the CUDA event GPU copies wait for), ``sources`` (eager copies made in batches),
    ``copies`` (the eager copies to free when the checkpoint ends), ``on_captured`` (run once every
    byte is copied: the checks, then the handle's capture). ``declined``: with many ranks, why this
    rank takes part in the step only to give it up."""

    plan: CheckpointPlan | Resolve
    on_captured: Callable[[], None]
    snapshot: EagerSnapshot
    ready: torch.cuda.Event | None = None
    sources: EagerSources | None = None
    copies: list[TensorItem] = field(default_factory=list)
    declined: BaseException | None = None

    @classmethod
    def declining(cls, error: BaseException, slab_size: int, on_captured: Callable[[], None]) -> Request:
        """An empty request for a rank whose listing failed: the other ranks are opening the step, so this
        one takes part, to decline it (every rank then gives the step up)."""
        return cls(plan_checkpoint([], slab_size), on_captured, EagerSnapshot(0, 0, ()), declined=error)


def prepare(
    step: int,
    leaves: Sequence[tuple[str, StateProvider]],
    describe: Callable[[], list],
    plans: PlanCache,
    rules: CaptureRules,
    check_capture: bool,
    captured: Callable[[], None],
) -> Request:
    """The request for ``step`` over the registered providers (``leaves``; ``describe`` lists them all).
    ``captured``: the handle's capture, run after the checks once every byte is copied."""
    prepared = plans.prepare(leaves, rules, defer=not check_capture)  # the capture check needs nothing deferred
    if prepared is not None:  # a reused plan, eager tensors copied in batches (plan_cache.py)
        resolve = prepared.resolve
        request = Request(resolve, captured, prepared.snapshot, sources=prepared.sources, copies=prepared.copies)
        described, watch = prepared.described, prepared.watch()  # a reused plan's are on the CPU: not described
        planned: Callable[[], list[TensorItem]] = lambda: resolve.known().tensors  # noqa: E731
    else:
        plan = plan_checkpoint(describe(), plans.chunk_size)
        # Tensors that may change before their lazy copy are copied now (laziness.py).
        snapshot, copies = rules.snapshot_eager(plan.tensors)
        request = Request(plan, captured, snapshot, copies=copies)
        described = plan.tensors
        watch = VersionWatch(VersionWatch.declared(plan.tensors))
        planned = lambda: described  # noqa: E731
    if check_capture:
        request.on_captured = _fingerprinted(step, planned(), rules, request.on_captured)
    request.on_captured = _tripwire(watch, step, request.on_captured)
    request.ready = record_ready_event([item.tensor for item in described])
    return request


def _fingerprinted(
    step: int, tensors: list[TensorItem], rules: CaptureRules, then: Callable[[], None]
) -> Callable[[], None]:
    """``policies.check_capture``: hash the lazily captured tensors now, and again once they are all copied
    but before the optimizer may step; a difference fails the checkpoint, naming the keys."""
    covered = rules.covered()
    lazy = [item for item in tensors if rules.lazy(item, covered)]
    before = fingerprints(lazy)

    def check_then() -> None:
        changed = changed_keys(before, lazy)
        if changed:
            raise CaptureChangedError(
                f"checkpoint step {step}: {len(changed)} lazily captured tensor(s) changed between the request "
                f"and their copy: {shown(changed)}; declare them changes='any' or call runner.wait_captured() "
                "before changing them"
            )
        then()

    return check_then


def _tripwire(watch: VersionWatch, step: int, then: Callable[[], None]) -> Callable[[], None]:
    """``then``, once capture is done, unless a declared-lazy tensor was changed in place since the
    request (laziness.VersionWatch): that checkpoint fails naming the keys, before it is committed."""

    def check_then() -> None:
        moved = watch.moved()
        if moved:
            raise CaptureChangedError(
                f"checkpoint step {step}: {len(moved)} tensor(s) declared changes='never' or 'guarded' were "
                f"changed in place between the request and their copy: {shown(moved)}; declare them "
                "changes='any' (ModuleProvider(frozen='any') for frozen parameters) or call "
                "runner.wait_captured() first"
            )
        then()

    return check_then
