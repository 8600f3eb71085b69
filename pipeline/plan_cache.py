"""Reusing a checkpoint's plan while the state holds the same tensor objects, and copying its eager
tensors in a few batched calls: what keeps the trainer's side of ``checkpoint()`` short for 10^5 tensors.

Describing, planning and cloning cost a few microseconds per tensor in Python, which is most of a
second for 10^5 small tensors (optimizer state of a large or mixture-of-experts model). A provider
that can list its tensors cheaply (``tensor_batch()``: :class:`TensorDictProvider`, :class:`ModuleProvider`,
:class:`OptimizerProvider`) is described and planned once, after checking that the listing is what
``describe()`` gives (same keys, memory and ``changes``; its other items alike); on later checkpoints
the runner only checks, in C loops, that it lists the very same tensor objects under the same keys
and ``changes``, and reuses the plan. The items listed apart (an optimizer's skeleton with its
learning rates) are planned afresh at every request. Its eager tensors (see laziness.py) are then
copied on the trainer's thread by one ``torch.stack`` per (dtype, shape) group, which also checks
that every tensor still has its planned shape (stack refuses any other) and no wider dtype (the
stack's dtype would widen); capture copies their bytes out of those stacks.

What the trainer's thread cannot afford to check per tensor is checked in the background before
any byte is captured (:class:`Resolve`): that every planned tensor object still has the dtype,
shape and device it was planned with. A tensor changed that way in place (``t.data = ...``,
``resize_``) fails that checkpoint, since the snapshot may then not be what its plan says, and the
next checkpoint describes and plans afresh. Nothing is ever saved under a wrong dtype or shape.

An attached optimizer's state is not even listed on the trainer's thread while its outline (state
mapping, its length, the groups' sizes) stays as it was: its step and ``load_state_dict`` wait for
the capture, so the state it holds at the request is still there in the background, where
:class:`Resolve` lists it before any capture. The same tensors: the plan stands. Others (an optimizer
that replaces its state tensors at each step): that optimizer's part is planned again there, the
rest of the plan and the eager copies kept; what cannot be (the set of eager tensors would change,
new tensors alias planned ones) fails that checkpoint, and the next one plans on the trainer's thread.

Used for CPU tensors (one process or many ranks: each rank reuses its own plan, and the commit takes
this rank's share of it per checkpoint); DTensors and device tensors take the plain path (describe,
plan, clone per tensor) in the runner.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from tierstate.errors import TierstateError

from ..providers.base import Batched, DeferredListing, StateProvider
from ..providers.dtensor import is_dtensor
from ..providers.items import Item, TensorBatch, TensorItem
from .laziness import CaptureRules, EagerSnapshot, VersionWatch
from .listing import FORM, as_described, same_batches
from .plan import CheckpointPlan, plan_checkpoint, tensor_layout
from .units import ChunkPlan, EagerSources


class PlanChangedError(TierstateError, RuntimeError):
    """A planned tensor changed dtype, shape or device in place while its checkpoint was being taken."""


@dataclass
class EagerGroup:
    """Eager tensors of one dtype and shape, copied together by one ``torch.stack``."""

    dtype: torch.dtype
    shape: tuple[int, ...]
    tensors: list[torch.Tensor]

    def stack(self) -> torch.Tensor | None:
        """The stacked copy, or None if a tensor no longer has the planned shape or dtype."""
        try:
            with torch.no_grad():  # a module's parameters are listed as themselves: no autograd graph for the copy
                copy = torch.stack(self.tensors)
        except RuntimeError:  # stack refuses tensors of different shapes
            return None
        if copy.dtype != self.dtype or tuple(copy.shape[1:]) != self.shape or copy.device.type != "cpu":
            return None
        return copy


@dataclass
class Prepared:
    """What the trainer's thread hands the job: the plan, what was copied, where capture finds copies."""

    snapshot: EagerSnapshot
    copies: list[TensorItem]  # plain-path copies, released when the checkpoint ends
    sources: EagerSources
    resolve: Resolve  # gives the plan, in the background: joining the parts touches every planned item

    @property
    def described(self) -> list[TensorItem]:
        """The tensors of the providers described this time (not from the reused plan)."""
        return self.resolve.rest.tensors

    def watch(self) -> VersionWatch:
        """The version tripwire over the declared-lazy tensors, the reused plan's listed once with it."""
        return VersionWatch([*self.resolve.entry.declared, *VersionWatch.declared(self.described)])


@dataclass
class Entry:
    """The plan of the batch providers' tensors, and what it was made for."""

    batches: dict[str, TensorBatch]  # provider path -> the tensors it was planned for
    covered: frozenset[int]  # the attached optimizers' storages when it was planned
    plan: CheckpointPlan
    groups: list[EagerGroup]
    where: dict[str, tuple[int, int]]
    eager_bytes: int
    uncovered: tuple[str, ...]
    invalid: bool = False
    tensors: list[torch.Tensor] = field(init=False)  # every planned tensor, lazy ones too
    forms: list[tuple[torch.dtype, torch.Size, torch.device]] = field(init=False)  # as planned
    declared: list[TensorItem] = field(init=False)  # lazy on the user's word: the version tripwire's

    def __post_init__(self) -> None:
        self.tensors = [item.tensor for item in self.plan.tensors]
        self.forms = list(map(FORM, self.tensors))
        self.declared = VersionWatch.declared(self.plan.tensors)

    def matches(self, batches: dict[str, TensorBatch], covered: frozenset[int]) -> bool:
        """Same providers, keys, ``changes`` and tensor objects, same coverage: C loops, no per-item Python.
        The coverage is the same object unless it was computed again (a restore gave an optimizer a new
        state mapping holding the same tensors): then it is compared once by value."""
        if self.invalid or not same_batches(batches, self.batches):
            return False
        if covered is not self.covered:
            if covered != self.covered:
                return False
            self.covered = covered
        return True

    def check_forms(self) -> None:
        """In the background, before capture: every planned tensor still has its planned dtype, shape and device."""
        if list(map(FORM, self.tensors)) == self.forms:  # a C loop: ~0.2 s less for 10^5 tensors
            return
        for tensor, form in zip(self.tensors, self.forms, strict=True):
            if FORM(tensor) != form:
                self.invalid = True
                dtype, shape, device = form
                raise PlanChangedError(
                    f"a tensor planned as {dtype} {list(shape)} on {device} is now {tensor.dtype} "
                    f"{list(tensor.shape)} on {tensor.device}: it was changed in place (t.data = ..., resize_) "
                    "while this checkpoint was taken; the next checkpoint plans afresh"
                )


class PlanCache:
    """The runner's one cached plan (one checkpoint is in flight at a time, so one is enough)."""

    def __init__(self, chunk_size: int) -> None:
        self.chunk_size = chunk_size
        self._entry: Entry | None = None
        # Batches that cannot be planned for reuse (a GPU tensor, a dtype stack cannot copy): not
        # described twice per checkpoint while they stay the same.
        self._refused: dict[str, TensorBatch] | None = None

    def prepare(
        self, leaves: Sequence[tuple[str, StateProvider]], rules: CaptureRules, defer: bool = True
    ) -> Prepared | None:
        """The plan and the eager copies of this checkpoint, or None when no provider offers a batch.

        ``defer``: an attached optimizer's state whose outline has not moved is taken as last listed and
        listed again in the background (:class:`Resolve`); False lists everything now (the capture check
        fingerprints every lazy tensor at the request, so it needs them all). ``leaves``: every registered
        provider by its path."""
        entry = self._entry
        deferred = _deferrable(leaves, entry, rules) if defer and entry is not None and not entry.invalid else {}
        batches = _listed(leaves, deferred)
        if not batches or (self._refused is not None and same_batches(batches, self._refused)):
            return None
        covered = rules.covered() if entry is not None else frozenset()  # with no plan yet, refreshed below
        stacks = _stack_all(entry.groups) if entry is not None and entry.matches(batches, covered) else None
        if entry is None or stacks is None:
            if deferred:  # planned afresh: from the state as it is now
                deferred, batches = {}, _listed(leaves, {})
            covered = rules.covered(refresh=True)
            entry = self._entry = _build(batches, dict(leaves), rules, covered, self.chunk_size)
            stacks = _stack_all(entry.groups) if entry is not None else None
            if entry is None or stacks is None:
                self._entry, self._refused = None, batches
                return None
        others = [_prefixed(path, item) for path, leaf in leaves if path not in batches for item in leaf.describe()]
        others += [_prefixed(path, item) for path, batch in batches.items() for item in batch.others]
        rest = plan_checkpoint(others, self.chunk_size)
        snapshot, copies = rules.snapshot_eager(rest.tensors, covered)
        eager = EagerSnapshot(
            snapshot.tensors + len(entry.where),
            snapshot.nbytes + entry.eager_bytes,
            entry.uncovered + snapshot.uncovered,
        )
        flat = [s.reshape(-1).view(torch.uint8).numpy() for s in stacks]
        resolve = Resolve(self, entry, rest, {path: provider for path, (provider, _) in deferred.items()}, rules)
        return Prepared(eager, copies, EagerSources(entry.where, flat), resolve)

    def relist(
        self, entry: Entry, deferred: dict[str, DeferredListing], rules: CaptureRules, rest: CheckpointPlan
    ) -> Entry:
        """In the background: the deferred optimizers' state listed now, and ``entry`` planned again for it if
        it holds other tensors (an optimizer that replaces its state tensors at each step); the skeletons in
        ``rest`` then name the new keys. Raises :class:`PlanChangedError` where that cannot be done safely."""
        fresh = {path: provider.relisted() for path, provider in deferred.items()}
        changed = {
            path: batch
            for path, batch in fresh.items()
            if batch is None or not same_batches({path: batch}, {path: entry.batches[path]})
        }
        for path, batch in fresh.items():
            if batch is not None and path not in changed:
                entry.batches[path] = batch  # the same tensors, as last listed: what regrouped() is given next
        if not changed:
            return entry
        try:
            replanned = _replanned(entry, changed, deferred, rules, self.chunk_size)
        except BaseException:
            entry.invalid = True  # the next checkpoint lists and plans everything on the trainer's thread
            raise
        for path, batch in changed.items():
            if batch is not None and batch.keys != entry.batches[path].keys:
                _restate(rest, path, deferred[path])
        if self._entry is entry:
            self._entry = replanned
        return replanned


@dataclass
class Resolve:
    """Run in the background before any capture (the optimizer's step waits for the capture): the plan the
    job writes. Lists the deferred optimizers' state (:meth:`PlanCache.relist`) and checks that every planned
    tensor still has its planned form (:meth:`Entry.check_forms`)."""

    cache: PlanCache
    entry: Entry
    rest: CheckpointPlan
    deferred: dict[str, DeferredListing]
    rules: CaptureRules

    def __call__(self) -> CheckpointPlan:
        entry = self.entry
        if self.deferred:
            entry = self.cache.relist(entry, self.deferred, self.rules, self.rest)
        entry.check_forms()
        return _combine(entry.plan, self.rest)

    def known(self) -> CheckpointPlan:
        """The plan as known at the request, for the capture check (nothing is deferred when it runs)."""
        return _combine(self.entry.plan, self.rest)


def _deferrable(
    leaves: Sequence[tuple[str, StateProvider]], entry: Entry, rules: CaptureRules
) -> dict[str, tuple[DeferredListing, TensorBatch]]:
    """The providers of attached optimizers whose state may be taken as ``entry`` planned it, each with that
    listing and its parameter groups snapshotted now (see optimizer_batch.py)."""
    found = {}
    for path, leaf in leaves:
        if (
            isinstance(leaf, DeferredListing)
            and path in entry.batches
            and any(leaf.optimizer_to_attach() is attached for attached in rules.optimizers)
        ):
            batch = leaf.regrouped(entry.batches[path])
            if batch is not None:
                found[path] = (leaf, batch)
    return found


def _listed(
    leaves: Sequence[tuple[str, StateProvider]], deferred: dict[str, tuple[DeferredListing, TensorBatch]]
) -> dict[str, TensorBatch]:
    """Each batch provider's listing (a deferred one's as it was), those that have one."""
    batches = {}
    for path, leaf in leaves:
        if path in deferred:
            batches[path] = deferred[path][1]
        elif isinstance(leaf, Batched) and (batch := leaf.tensor_batch()) is not None:
            batches[path] = batch
    return batches


def _replanned(
    entry: Entry,
    changed: dict[str, TensorBatch | None],
    providers: dict[str, DeferredListing],
    rules: CaptureRules,
    chunk_size: int,
) -> Entry:
    """``entry`` with the optimizers in ``changed`` planned from their new listing, in the background: the
    other tensors as planned, the eager ones already copied (the set must not change)."""
    prefixes = tuple(f"{path}/" for path in changed)
    items = [item for item in entry.plan.tensors if not item.key.startswith(prefixes)]
    batches = dict(entry.batches)
    for path, batch in changed.items():
        if batch is None:
            raise PlanChangedError(
                f"optimizer {path!r}: its state can no longer be listed (a value that is not a tensor, or a "
                "state-dict hook) since this checkpoint was requested; the next checkpoint describes it afresh"
            )
        batches[path] = batch
        replicated = providers[path].replicated
        for index, (key, tensor) in enumerate(zip(batch.keys, batch.tensors, strict=True)):
            if not isinstance(tensor, torch.Tensor) or is_dtensor(tensor) or tensor.device.type != "cpu":
                where = f" on {tensor.device}" if isinstance(tensor, torch.Tensor) else ""
                raise PlanChangedError(
                    f"optimizer {path!r}: state {key!r} is now a {type(tensor).__name__}{where}; "
                    "the next checkpoint plans afresh"
                )
            changes = batch.changes_of(index)
            items.append(TensorItem(f"{path}/{key}", tensor, replicated=replicated, changes=changes))
    plan = _reusable_plan(items, chunk_size)
    # The aliases among the tensors kept as planned (tied weights) are not among ``items``: carried over.
    kept = {key: target for key, target in entry.plan.aliases.items() if not key.startswith(prefixes)}
    if plan is None or any(target.startswith(prefixes) for target in kept.values()):
        raise PlanChangedError(
            f"optimizer state of {', '.join(map(repr, changed))} now shares memory with other planned tensors; "
            "the next checkpoint plans afresh"
        )
    plan.aliases |= kept
    covered = rules.covered(refresh=True)
    if {item.key for item in rules.eager(plan.tensors, covered)} != entry.where.keys():
        raise PlanChangedError(
            f"optimizer {', '.join(map(repr, changed))} changed which tensors it holds, and so which must be "
            "copied before checkpoint() returns; the next checkpoint plans afresh"
        )
    return dataclasses.replace(entry, batches=batches, covered=covered, plan=plan)  # tensors and forms: its own


def _restate(rest: CheckpointPlan, path: str, provider: DeferredListing) -> None:
    """The objects ``rest`` holds for ``path`` (snapshotted at the request), brought up to date with its
    provider's new listing (an optimizer's skeleton names the new keys)."""
    prefix = f"{path}/"
    for item in rest.objects:
        if item.key.startswith(prefix):
            item.value = provider.restated(item.key[len(prefix) :], item.value)


def _stack_all(groups: list[EagerGroup]) -> list[torch.Tensor] | None:
    stacks = []
    for group in groups:
        stacked = group.stack()
        if stacked is None:
            return None
        stacks.append(stacked)
    return stacks


def _prefixed(path: str, item: Item) -> Item:
    return dataclasses.replace(item, key=f"{path}/{item.key}")


def _build(
    batches: dict[str, TensorBatch],
    leaves: dict[str, StateProvider],
    rules: CaptureRules,
    covered: frozenset[int],
    chunk_size: int,
) -> Entry | None:
    """Describe the batch providers once and plan them; None if one describes other than its batch
    says, or holds a tensor off the CPU (those take the plain path)."""
    items: list[TensorItem] = []
    for path, batch in batches.items():
        described = leaves[path].describe()
        planned = as_described(batch, described, f"{path}/")
        if planned is None:
            return None
        items += planned
    if any(item.tensor.device.type != "cpu" for item in items):
        return None
    plan = _reusable_plan(items, chunk_size)
    if plan is None:
        return None
    eager = rules.eager(plan.tensors, covered)
    groups: dict[tuple[torch.dtype, tuple[int, ...]], tuple[int, EagerGroup]] = {}
    where: dict[str, tuple[int, int]] = {}
    for item in eager:
        form = (item.tensor.dtype, tuple(item.tensor.shape))
        if form not in groups:
            groups[form] = (len(groups), EagerGroup(form[0], form[1], []))
        index, group = groups[form]
        where[item.key] = (index, len(group.tensors) * item.nbytes)
        group.tensors.append(item.tensor)
    uncovered = tuple(item.key for item in eager if item.changes == "step")
    eager_groups = [group for _, group in groups.values()]
    eager_bytes = sum(i.nbytes for i in eager)
    return Entry(batches, covered, plan, eager_groups, where, eager_bytes, uncovered)


def _reusable_plan(items: list[TensorItem], chunk_size: int) -> CheckpointPlan | None:
    """``items`` planned with the form each is stored under fixed now, whatever happens later; None if two
    distinct tensor objects share storage. Which tensors alias is not checked per checkpoint, and a view's
    storage may be swapped under the same object (``t.data = ...``): those take the plain path. One object
    under two keys (tied weights) stays its own alias while the reused plan's objects are the same."""
    plan = plan_checkpoint(items, chunk_size)
    tensors = {item.key: item.tensor for item in items}
    if any(tensors[key] is not tensors[target] for key, target in plan.aliases.items()):
        return None
    plan.layouts = {item.key: tensor_layout(item) for item in plan.tensors}
    return plan


def _combine(first: CheckpointPlan, second: CheckpointPlan) -> CheckpointPlan:
    """``first``'s chunks, then ``second``'s, renumbered; ``first`` is reused as it is."""
    if not second.tensors and not second.objects and not second.aliases:
        return first
    shift = len(first.chunks)
    chunks = first.chunks + [ChunkPlan(c.index + shift, c.pieces, c.nbytes) for c in second.chunks]
    combined = CheckpointPlan(first.tensors + second.tensors, second.objects, first.aliases | second.aliases, chunks)
    combined.layouts = first.layouts
    return combined
