"""Many ranks on torch.distributed: a dedicated checkpoint group and a two-phase commit over it.

Every rank runs its own runner and writes its own ``rank-NNNNN.data`` / ``.index`` into the
shared ``step-N.partial/``. A checkpoint exists only once every rank's part is durable:

1. open: rank 0 creates the partial directory; all ranks exchange which replicated items they hold
   and compute the same assignment, so each replicated item is written by exactly one rank and the
   bytes are spread (:func:`pipeline.assign.balance`).
2. prepare: each rank writes and fsyncs its files, then votes: its manifest part, or why it failed.
3. decide: rank 0 merges the parts into the global manifest and publishes it by the tier's atomic
   rename, or removes the partial directory if any rank voted no; then it tells every rank.

The collectives run on a gloo group of their own, created once by the runner, so they never queue
behind or deadlock with the training group's (NCCL) collectives, and they run in the runner's
I/O threads, never on the trainer's. A rank that dies or stops answering makes the others'
collectives fail (gloo notices a closed connection at once; a hung rank after the group timeout):
no global commit happens, their handles say why, training goes on, and since the group's
collective sequence is lost, later checkpoints fail at once with the same reason.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from collections import defaultdict
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any, TypeVar

import torch
import torch.distributed as dist

from tierstate.errors import TierstateError

from ..providers.items import ObjectItem, TensorItem
from ..tiers.format.format import ManifestBody
from ..tiers.format.manifest import Manifest
from ..tiers.format.multirank import RankPart, merge_parts
from ..tiers.storage.filesystem import FilesystemTier
from ..tiers.storage.nodeparts import node_part
from ..tiers.storage.nodes import node_name
from ..tiers.storage.safeopen import check_regular
from .assign import balance
from .plan import CheckpointPlan, plan_checkpoint

log = logging.getLogger("tierstate")
T = TypeVar("T")

# Fault injection for tests: "RANK:STEP" makes that rank leave the process (exit status 0, so that
# torchrun lets the surviving ranks run on and report) after writing its files, before voting.
EXIT_BEFORE_VOTE_ENV = "TIERSTATE_TEST_EXIT_BEFORE_VOTE"


class CheckpointAborted(TierstateError, RuntimeError):
    """A multi-rank checkpoint that was not committed; the message says which rank and why."""


class GroupLost(CheckpointAborted):
    """The checkpoint group cannot be used any more: a rank died, hung past the timeout, or diverged."""


def wanted_group(distributed: bool | None) -> bool:
    """Whether a runner works across ranks: asked for, or (None) torch.distributed runs on several."""
    running = dist.is_available() and dist.is_initialized()
    if distributed and not running:
        raise RuntimeError("Runner(distributed=True) needs torch.distributed.init_process_group() first")
    if distributed is None:
        return running and dist.get_world_size() > 1
    return bool(distributed)


class CheckpointGroup:
    """The runner's own gloo group over all ranks, plus one per node for restore's exchange.

    Nodes are told apart by :func:`tiers.storage.nodes.node_name` (the hostname, or ``TIERSTATE_NODE``).
    Created collectively (every rank must construct its runner at the same point of the program).
    """

    def __init__(self, timeout: timedelta) -> None:
        self.rank = dist.get_rank()
        self.world_size = dist.get_world_size()
        self.timeout = timeout
        self.broken: str | None = None
        self.group = _member(dist.new_group(backend="gloo", timeout=timeout), "checkpoint")
        names: list[Any] = [None] * self.world_size
        dist.all_gather_object(names, node_name(), group=self.group)
        by_node: dict[str, list[int]] = defaultdict(list)
        for rank, name in enumerate(names):
            by_node[name].append(rank)
        self.node_name: str = names[self.rank]
        self.nodes = dict(sorted(by_node.items()))  # node name -> its ranks, ascending
        self.node_ranks = by_node[self.node_name]
        self.node = self.group
        if len(by_node) > 1:
            node, _ = dist.new_subgroups_by_enumeration(sorted(by_node.values()), timeout=timeout, backend="gloo")
            self.node = _member(node, "node")

    @property
    def is_leader(self) -> bool:
        return self.rank == 0

    @property
    def is_node_leader(self) -> bool:
        """The rank that opens, commits and flushes this node's part on a node-scoped tier."""
        return self.rank == self.node_ranks[0]

    def _run(self, what: str, fn: Callable[[], T]) -> T:
        if self.broken is not None:
            raise GroupLost(f"{what}: the checkpoint group is unusable since {self.broken}")
        try:
            return fn()
        except Exception as exc:  # gloo: connection reset by a dead peer, timeout, or a mismatch
            self.broken = f"{what} failed on rank {self.rank} ({type(exc).__name__}: {exc})"
            raise GroupLost(f"{what}: lost the checkpoint group: {type(exc).__name__}: {exc}") from exc

    def all_gather(self, value: Any, what: str) -> list[Any]:
        return self._gather(value, what, self.group, self.world_size)

    def side_gather(self, what: str) -> Callable[[Any], list[Any]]:
        """An all-gather over a gloo group of its own, made at its first call: for the trainer's thread, whose
        collectives must not interleave with those the pipeline's threads run on :attr:`group` meanwhile (a
        commit). Collective: every rank's first call comes at the same point of the program."""
        own: list[dist.ProcessGroup] = []

        def gather(value: Any) -> list[Any]:
            if not own:
                own.append(_member(dist.new_group(backend="gloo", timeout=self.timeout), what))
            return self._gather(value, what, own[0], self.world_size)

        return gather

    def node_all_gather(self, value: Any, what: str) -> list[Any]:
        """One value per rank of this node, in the order of :attr:`node_ranks`."""
        return self._gather(value, what, self.node, len(self.node_ranks))

    def _gather(self, value: Any, what: str, group: dist.ProcessGroup, size: int) -> list[Any]:
        out: list[Any] = [None] * size

        def gather() -> list[Any]:
            dist.all_gather_object(out, value, group=group)
            return out

        return self._run(what, gather)

    def gather_to_leader(self, value: Any, what: str) -> list[Any] | None:
        out: list[Any] | None = [None] * self.world_size if self.is_leader else None

        def gather() -> list[Any] | None:
            dist.gather_object(value, out, dst=0, group=self.group)
            return out

        return self._run(what, gather)

    def from_leader(self, value: Any, what: str) -> Any:
        """The leader's ``value`` on every rank (the others pass None)."""
        box = [value]

        def broadcast() -> Any:
            dist.broadcast_object_list(box, src=0, group=self.group)
            return box[0]

        return self._run(what, broadcast)

    def node_broadcast(self, tensor: torch.Tensor, src: int, what: str) -> None:
        """Broadcast a host tensor from global rank ``src`` to the ranks of its node, in place."""
        self._run(what, lambda: dist.broadcast(tensor, src=src, group=self.node))

    def broadcast(self, tensor: torch.Tensor, src: int, what: str) -> None:
        """Broadcast a host tensor from global rank ``src`` to every rank, in place."""
        self._run(what, lambda: dist.broadcast(tensor, src=src, group=self.group))

    def close(self) -> None:
        """Release the groups, unless torch.distributed is already shut down (which released them)."""
        if dist.is_initialized():
            groups = {self.group, self.node}
            for group in groups:
                dist.destroy_process_group(group)


def _member(group: dist.ProcessGroup | int | None, which: str) -> dist.ProcessGroup:
    """A group this rank belongs to, as torch's untyped constructors return it (None or an int
    marker for a rank outside the group; every rank is inside the groups made here)."""
    if not isinstance(group, dist.ProcessGroup):
        rank = dist.get_rank()
        raise GroupLost(f"rank {rank} is not a member of the {which} group torch.distributed created ({group!r})")
    return group


def _reason(error: BaseException) -> str:
    """What a vote says about a failure: the first real error, not the TaskGroup wrapping it."""
    while isinstance(error, BaseExceptionGroup) and error.exceptions:
        error = error.exceptions[0]
    return f"{type(error).__name__}: {error}"


def _replica(item: TensorItem | ObjectItem) -> tuple[tuple[str, tuple[int, ...] | None], str, int]:
    """``(identity, signature, bytes)``: replicas share the key and the place, so shards of one tensor
    at different offsets are different items; the signature must then agree across ranks."""
    if isinstance(item, ObjectItem):
        return (item.key, None), "object", 0
    offsets = tuple(item.shard.offsets) if item.shard is not None else None
    return (item.key, offsets), f"{str(item.tensor.dtype).removeprefix('torch.')}{list(item.tensor.shape)}", item.nbytes


class DistributedCommit:
    """The two-phase commit of one checkpoint on one rank (see the module docstring)."""

    def __init__(
        self,
        group: CheckpointGroup,
        tier: FilesystemTier,
        chunk_size: int,
        declined: BaseException | None = None,
        node_scoped: bool = False,
    ) -> None:
        """``declined``: why this rank cannot take part (its state failed to describe); it still
        joins the opening, so that every rank gives the step up instead of waiting for this one.
        ``node_scoped``: ``tier`` is this node's own directory; each node's leader opens and commits
        its node's part (tiers/storage/nodeparts.py), and the step exists once every node committed its part."""
        self.group = group
        self.tier = tier
        self.chunk_size = chunk_size
        self.declined = declined
        self.node_scoped = node_scoped
        self._opens = group.is_node_leader if node_scoped else group.is_leader  # creates the partial directory
        self._open = False
        self._replicated: set[str] = set()

    def decline(self, reason: Exception) -> bool:
        """Its plan failed in the background: it still joins the opening, so every rank gives the step up."""
        self.declined = reason
        return True

    # --- phase 1: open ------------------------------------------------------------------------
    def begin(self, step: int, plan: CheckpointPlan) -> tuple[Path, CheckpointPlan]:
        refused = None if self.declined is None else _reason(self.declined)
        if self._opens and refused is None:
            try:
                self.tier.begin(step)
            except Exception as exc:
                refused = f"could not open it: {_reason(exc)}"
        replicas = [_replica(item) for item in [*plan.tensors, *plan.objects] if item.replicated]
        own = sum(t.nbytes for t in plan.tensors if not t.replicated)
        offer = {"step": step, "refused": refused, "replicas": replicas, "own_bytes": own}
        try:
            offers = self.group.all_gather(offer, f"step {step}: opening")
            mine = self._my_replicas(step, offers)
        except BaseException:
            if self._opens:
                self.tier.abort(step)
            raise
        self._open = True
        return self.tier.partial_dir(step), self._restrict(plan, mine)

    def _my_replicas(self, step: int, offers: list[dict[str, Any]]) -> set[str]:
        """Keys of the replicated items this rank writes; every rank computes the same answer."""
        steps = {offer["step"] for offer in offers}
        if len(steps) > 1:
            said = ", ".join(f"rank {r}: {o['step']}" for r, o in enumerate(offers))
            raise CheckpointAborted(f"ranks asked for different checkpoint steps at once ({said})")
        if self.declined is not None:
            raise self.declined  # this rank's own reason is what its handle reports
        refusals = [f"rank {rank}: {offer['refused']}" for rank, offer in enumerate(offers) if offer["refused"]]
        if refusals:
            raise CheckpointAborted(f"step {step} was not opened: {'; '.join(refusals)}")
        holders: dict[Any, list[int]] = defaultdict(list)
        sizes: dict[Any, int] = {}
        signatures: dict[Any, dict[str, int]] = defaultdict(dict)
        for rank, offer in enumerate(offers):
            for ident, signature, nbytes in offer["replicas"]:
                holders[ident].append(rank)
                sizes[ident] = nbytes
                signatures[ident].setdefault(signature, rank)
        for ident, seen in signatures.items():
            if len(seen) > 1:
                found = ", ".join(f"rank {rank} has {sig}" for sig, rank in seen.items())
                raise CheckpointAborted(f"step {step}: item {ident[0]!r} is marked replicated but differs: {found}")
        load = {rank: offer["own_bytes"] for rank, offer in enumerate(offers)}
        chosen = balance(sizes, holders, load)
        return {ident[0] for ident, rank in chosen.items() if rank == self.group.rank}

    def _restrict(self, plan: CheckpointPlan, mine: set[str]) -> CheckpointPlan:
        """The part of ``plan`` this rank writes: its own items and the replicas assigned to it."""
        keep = {i.key for i in [*plan.tensors, *plan.objects] if not i.replicated or i.key in mine}
        tensors = [t for t in plan.tensors if t.key in keep]
        objects = [o for o in plan.objects if o.key in keep]
        self._replicated = {i.key for i in [*tensors, *objects] if i.replicated}
        aliases = {key: target for key, target in plan.aliases.items() if target in keep}
        self._replicated |= {key for key, target in aliases.items() if target in self._replicated}
        return dataclasses.replace(plan_checkpoint([*tensors, *objects], self.chunk_size), aliases=aliases)

    # --- phases 2 and 3: vote, decide -----------------------------------------------------------
    def commit(self, step: int, manifest: ManifestBody) -> Path:
        if os.environ.get(EXIT_BEFORE_VOTE_ENV) == f"{self.group.rank}:{step}":
            log.warning("%s: rank %d leaves before voting on step %d", EXIT_BEFORE_VOTE_ENV, self.group.rank, step)
            os._exit(0)
        return self._decide(step, {"part": manifest, "replicated": sorted(self._replicated), "refused": None})

    def abort(self, step: int, error: BaseException) -> None:
        """Vote no if this rank's part failed while the checkpoint was open; the leader cleans up."""
        if not self._open:
            return  # never opened, or already decided: the leader has removed the partial directory
        try:
            self._decide(step, {"part": None, "replicated": [], "refused": _reason(error)})
        except CheckpointAborted:
            pass  # the expected outcome of a no vote; this rank's own error is what its handle reports

    def _decide(self, step: int, vote: dict[str, Any]) -> Path:
        self._open = False
        try:
            votes = self.group.gather_to_leader(vote, f"step {step}: collecting votes")
            outcome = self._outcome(step, votes) if votes is not None else None
            outcome = self.group.from_leader(outcome, f"step {step}: announcing the outcome")
        except GroupLost:
            if self._opens:
                self.tier.abort(step)
            raise
        if "refused" in outcome:
            if self._opens:
                self.tier.abort(step)  # a no-op where the leader already removed it
            raise CheckpointAborted(outcome["refused"])
        if "whole" in outcome:
            return self._commit_node_parts(step, outcome["whole"])
        return Path(outcome["path"])

    def _commit_node_parts(self, step: int, whole: Manifest) -> Path:
        """Node scope: each node's leader commits its part; the step stands only if every node's did."""
        error = None
        if self._opens:
            try:
                part = node_part(whole, self.group.node_name, self.group.node_ranks, list(self.group.nodes))
                self._check_visible(step, part)
                self.tier.commit(step, part)
            except Exception as exc:
                error = f"node {self.group.node_name} (rank {self.group.rank}): {_reason(exc)}"
                self.tier.abort(step)
        try:
            said = self.group.all_gather(error, f"step {step}: committing the node parts")
        except GroupLost:
            self._withdraw(step, error)
            raise
        failures = [text for text in said if text is not None]
        if failures:
            self._withdraw(step, error)
            raise CheckpointAborted(f"step {step} was not committed: {'; '.join(failures)}")
        return self.tier.step_dir(step)

    def _withdraw(self, step: int, error: str | None) -> None:
        """Delete this node's committed part of a step that another node failed to commit."""
        if self._opens and error is None:
            try:
                self.tier.delete_step(step)
            except OSError as exc:
                log.error("step %d: could not withdraw node %s's part: %s", step, self.group.node_name, exc)

    def _check_visible(self, step: int, merged: Manifest) -> None:
        """Every rank's files must be here, whole: a tier that is not one shared directory fails now."""
        partial = self.tier.partial_dir(step)
        for name, record in merged.files.items():
            path = partial / name
            try:
                size = check_regular(path).st_size  # the file itself: a planted symlink is refused, not followed
            except FileNotFoundError:
                size = None
            if size != record.size:
                seen = "missing" if size is None else f"{size} bytes, not {record.size}"
                raise CheckpointAborted(
                    f"{path} is {seen} as rank {self.group.rank} sees it; with many ranks, tier {self.tier.name} "
                    f"({self.tier.root}) must be one directory that every rank shares, or say scope: node"
                )

    def _outcome(self, step: int, votes: list[dict[str, Any]]) -> dict[str, Any]:
        """On the leader: commit if every rank voted yes, else remove the partial directory."""
        refusals = [f"rank {rank}: {v['refused']}" for rank, v in enumerate(votes) if v["refused"]]
        if not refusals:
            try:
                parts = [
                    RankPart(rank, Manifest.model_validate(v["part"]), frozenset(v["replicated"]))
                    for rank, v in enumerate(votes)
                ]
                merged = merge_parts(step, parts)
                if self.node_scoped:
                    return {"whole": merged}  # each node's leader commits its part of it
                self._check_visible(step, merged)
                return {"path": str(self.tier.commit(step, merged))}
            except Exception as exc:
                refusals = [f"rank 0 could not commit the global manifest: {_reason(exc)}"]
        self.tier.abort(step)
        return {"refused": f"step {step} was not committed: {'; '.join(refusals)}"}


def group_for_runner(
    distributed: bool | None, rank: int | None, in_flight: str, timeout_s: float
) -> CheckpointGroup | None:
    """The runner's checkpoint group, or None for one process; refuses settings ranks cannot share."""
    if not wanted_group(distributed):
        return None
    if rank is not None and rank != dist.get_rank():
        raise ValueError(f"Runner(rank={rank}) but torch.distributed says this is rank {dist.get_rank()}")
    if in_flight == "skip":
        raise ValueError(
            f"policies.in_flight: skip cannot be used with {dist.get_world_size()} ranks: each rank would skip "
            "different steps, and a checkpoint needs every rank on the same step; use wait"
        )
    return CheckpointGroup(timedelta(seconds=timeout_s))
