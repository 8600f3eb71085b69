"""Peer copies over the network: each node's part sent to its partner, and sent back to a replaced node.

``replicas: 1`` on a node-scoped tier (see :mod:`tiers.storage.peers` for where copies live). After a step's
part is on that tier on every node (committed there, or flushed there), each node's leader sends its
part's files to its partner node's leader, which verifies and publishes them as a peer copy and
applies the tier's retention to its peer copies. Before a restore, a node that lacks the newest step
its partner holds for it gets that copy sent back, and restores from it (slower than its own
copies, faster than the shared tier).

Every rank takes part in every transfer, in the same order: the transfers run one at a time in one
thread of their own, on a gloo group of their own (so they never interleave with the commit's
collectives), queued in the order the steps committed, which is the same on every rank. A transfer
is three rounds: every rank says what it will send to whom (file names and sizes, or why it has
nothing); the bytes go point to point, pair after pair, in chunks, paced by the tier's flush
bandwidth; every rank says whether its side went well. A sender that cannot read a file mid-way
still sends the announced number of bytes (zeros) and reports the failure, and a receiver that
cannot write goes on receiving, so neither side is left waiting; a copy is published only once
every byte checked out. A rank that dies or hangs makes the others' calls fail within the group
timeout; the link is then broken for good, and every later transfer and recall is skipped
(restore falls back to the node's own copies and the shared tier).

A job killed before its queued transfers ran leaves committed steps without their peer copy (a crash
between commit and copy; the copy of a part whose node was replaced is lost with it). A runner's
first commit therefore first sends what a previous run left unsent: every older step a node holds on
a replicated tier that its partner does not keep, oldest first, once the flushes that crash left
pending (pipeline/flush.py) have brought their steps to the tier; retention on the partner then
frees them by its rule, as for any copy.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import errno
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

import torch
import torch.distributed as dist

from tierstate.errors import TierstateError

from ..tiers.ops.pacing import Pacer
from ..tiers.ops.retention import TierPolicies, prune
from ..tiers.storage.filesystem import FilesystemTier
from ..tiers.storage.locks import reading
from ..tiers.storage.peers import ReceivedPart, kept_for, open_part_file, part_files, partner_of, returned_from
from .config import PipelineConfig
from .distributed import CheckpointGroup
from .flush import FlushFailure
from .handle import HandleCompleter
from .room import TierFullError, no_room_for

log = logging.getLogger("tierstate")
T = TypeVar("T")
CHUNK = 8 * 1024 * 1024


class PeerLinkLost(TierstateError, RuntimeError):
    """The peer group cannot be used any more: a rank died, hung past the timeout, or diverged."""


class PeerCopyFailed(TierstateError, RuntimeError):
    """A peer copy that did not arrive; says which rank and why."""


@dataclass
class _Offer:
    """What one rank sends in one transfer: ``files`` of ``tier``'s copy of ``step`` of ``node``'s part."""

    to: int
    tier: str
    step: int
    node: str  # whose part it is
    files: list[tuple[str, int]] = field(default_factory=list)


@dataclass
class _Side:
    """One rank's end of a transfer: what it sends or receives, and what went wrong."""

    sending: _Offer | None = None
    receiving: ReceivedPart | None = None
    error: str | None = None


class PeerLink:
    """The runner's peer copies: its own gloo group and one thread in which every transfer runs."""

    def __init__(
        self,
        config: PipelineConfig,
        tiers: list[FilesystemTier],
        group: CheckpointGroup,
        flushes_resumed: Callable[[], None],
    ) -> None:
        """Collective: every rank builds it at the same point (the runner's constructor).
        ``flushes_resumed`` waits for the flushes a crashed run left (see the module docstring)."""
        spare = len(group.nodes) - 1
        for tier in tiers:
            wanted = config.tiers[tier.name].replicas
            if wanted > spare:
                raise ValueError(
                    f"tiers.{tier.name}.replicas: {wanted} peer copies need {wanted + 1} nodes; "
                    f"this job runs on {len(group.nodes)} ({', '.join(group.nodes)})"
                )
        self._replicated = [t for t in tiers if config.tiers[t.name].replicas]
        self._config = config
        self._group = group
        self._leaders = {node: ranks[0] for node, ranks in group.nodes.items()}
        made = dist.new_group(backend="gloo", timeout=group.timeout)
        if not isinstance(made, dist.ProcessGroup):  # torch's untyped constructor: every rank is a member here
            raise PeerLinkLost(f"rank {group.rank} is not a member of the peer group torch.distributed created")
        self._pg = made
        self._thread = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="tierstate-peers")
        self._flushes_resumed = flushes_resumed
        self._resumed = False
        self.broken: str | None = None
        self.failures: list[FlushFailure] = []

    @classmethod
    def of(
        cls,
        config: PipelineConfig,
        tiers: list[FilesystemTier],
        group: CheckpointGroup | None,
        flushes_resumed: Callable[[], None],
    ) -> PeerLink | None:
        if group is None or not any(t.replicas for t in config.tiers.values()):
            return None
        return cls(config, tiers, group, flushes_resumed)

    # --- after a commit --------------------------------------------------------------------------
    def committed(self, completer: HandleCompleter) -> None:
        """Queue the peer copies of ``completer``'s step (called in commit order, alike on every rank); the
        first one queues before them the copies a previous run left unsent."""
        if not self._resumed:
            self._resumed = True
            self._thread.submit(self._resume, completer.step)
        self._thread.submit(self._replicate, completer)

    def _replicate(self, completer: HandleCompleter) -> None:
        step = completer.step
        leader = self._group.is_node_leader
        for tier in self._replicated:
            future = completer.handle.tier_futures.get(tier.name)
            if future is None:
                continue  # not due on this tier (flush.every): on no rank
            arrived = future.exception() is None  # waits for the copy to reach the tier (or to fail)
            missing = f"node {self._group.node_name}'s part of step {step} did not reach tier {tier.name}"
            if not self._copy(step, tier, leader and arrived, None if arrived or not leader else missing):
                return

    def _resume(self, first: int) -> None:
        """Send what a previous run left unsent: each step older than ``first`` (this runner's first commit)
        that a node holds on a replicated tier and its partner does not keep, oldest first."""
        self._flushes_resumed()
        nodes, me = list(self._group.nodes), self._group.node_name
        own = {t.name: [step for step in _listed(t) if step < first] for t in self._replicated}
        kept = {t.name: {n: _listed(kept_for(t, n)) for n in nodes if n != me} for t in self._replicated}
        try:
            said = self._run("peer copies left unsent: what each node holds", lambda: _gather(self._pg, (own, kept)))
        except PeerLinkLost as exc:
            log.error("peer copies a previous run left unsent are not sent: %s", exc)
            return
        for tier in self._replicated:
            unsent = _unsent(said, tier.name, self._leaders, nodes)
            for step, senders in sorted(unsent.items()):
                log.info("step %d: the peer copies on tier %s of node(s) %s were left unsent by a previous run: "
                         "sending them", step, tier.name, ", ".join(senders))  # fmt: skip
                if not self._copy(step, tier, self._group.is_node_leader and me in senders, None):
                    return

    def _copy(self, step: int, tier: FilesystemTier, sending: bool, error: str | None) -> bool:
        """Collective: one transfer of ``step``'s parts on ``tier`` to the partners (this rank's part if
        ``sending``; ``error``: why it has none to send); False once the peer link is lost."""
        side = _Side(error=error)
        if sending:
            partner = partner_of(list(self._group.nodes), self._group.node_name)
            side.sending = _Offer(self._leaders[partner], tier.name, step, self._group.node_name)
        try:
            outcome = self._transfer(f"step {step}: peer copies on tier {tier.name}", side, tier, kept_for)
        except PeerLinkLost as exc:
            self._failed(step, tier, exc)
            return False
        for text in outcome:
            self._failed(step, tier, PeerCopyFailed(text))
        if side.receiving is not None:
            self._prune(side.receiving.tier, tier)
        return True

    def _prune(self, copies: FilesystemTier, tier: FilesystemTier) -> None:
        try:
            prune([TierPolicies(copies, self._config.tiers[tier.name].retention)])
        except Exception as exc:  # logged like any retention failure, never raised into training
            log.error("retention on %s failed: %s: %s", copies.root, type(exc).__name__, exc)

    def _failed(self, step: int, tier: FilesystemTier, error: BaseException) -> None:
        failure = FlushFailure(step, f"{tier.name} (peer copy)", error)
        log.error("%s", failure)
        self.failures.append(failure)

    # --- before a restore ------------------------------------------------------------------------
    def recall(self, node_tiers: list[FilesystemTier]) -> list[FilesystemTier]:
        """Collective: get this node's newest part back from its partner if none of ``node_tiers`` (this
        node's own) holds that step; the tiers to read it from (none if nothing came back). Never raises:
        restore goes on without it."""
        try:
            return self._thread.submit(self._recall, node_tiers).result()
        except Exception as exc:
            log.error("restore: could not get this node's peer copy back: %s: %s", type(exc).__name__, exc)
            return []

    def _recall(self, node_tiers: list[FilesystemTier]) -> list[FilesystemTier]:
        nodes, me = list(self._group.nodes), self._group.node_name
        own = sorted({step for tier in node_tiers for step in _listed(tier)})
        held = {t.name: {n: _listed(kept_for(t, n)) for n in nodes if n != me} for t in self._replicated}
        said = self._run("restore: which peer copies each node holds", lambda: _gather(self._pg, (own, held)))
        wanted: dict[str, tuple[str, int]] = {}  # node -> (tier, step) its partner sends back; alike on every rank
        for node, leader in self._leaders.items():
            found = _newest_copy(said[self._leaders[partner_of(nodes, node)]][1], node, said[leader][0])
            if found is not None:
                wanted[node] = found
        returned: list[FilesystemTier] = []
        for tier in self._replicated:
            sent = {node: step for node, (name, step) in wanted.items() if name == tier.name}
            if not sent:
                continue
            side = _Side()
            for node, step in sent.items():
                if self._group.rank == self._leaders[partner_of(nodes, node)]:
                    side.sending = _Offer(self._leaders[node], tier.name, step, node)
            for problem in self._transfer("restore: peer copies sent back", side, tier, returned_from):
                log.error("restore: %s", problem)
            if me in sent:
                back = returned_from(tier, partner_of(nodes, me))
                if sent[me] in _listed(back):
                    log.info("restore: node %s's part of step %d came back from its peer copy", me, sent[me])
                    returned.append(back)
        return returned

    # --- one transfer ----------------------------------------------------------------------------
    def _transfer(
        self,
        what: str,
        side: _Side,
        tier: FilesystemTier,
        place: Callable[[FilesystemTier, str], FilesystemTier],
    ) -> list[str]:
        """Collective: every rank's offer announced, the bytes sent pair by pair, the outcomes told;
        the problems (alike on every rank). ``place``: where a receiver keeps what arrives."""
        theirs = side.sending is not None and side.sending.node != self._group.node_name  # sent back on recall
        source = kept_for(tier, side.sending.node) if side.sending is not None and theirs else tier
        with contextlib.ExitStack() as held:
            if side.sending is not None:
                try:
                    held.enter_context(reading(source.step_dir(side.sending.step)))  # retention waits meanwhile
                    side.sending.files = part_files(source, side.sending.step)
                except Exception as exc:
                    if _superseded(source, side.sending.step):
                        log.info("%s: step %d left tier %s for a newer step (retention): not sent", what,
                                 side.sending.step, source.name)  # fmt: skip
                    else:
                        side.error = f"{type(exc).__name__}: {exc}"
                    side.sending = None
            offers = self._run(f"{what}: announcing", lambda: _gather(self._pg, (side.sending, side.error)))
            pacer = Pacer(_bandwidth(self._config, tier.name))
            for src, (offer, _) in enumerate(offers):
                if offer is None or self._group.rank not in (src, offer.to):
                    continue
                if self._group.rank == src:
                    self._send(what, source, offer, side, pacer)
                else:
                    sender = next(n for n, ranks in self._group.nodes.items() if src in ranks)
                    self._receive(what, place(tier, sender), offer, src, side, tier)
        said = self._run(f"{what}: outcomes", lambda: _gather(self._pg, side.error))
        return [f"rank {rank}: {text}" for rank, text in enumerate(said) if text is not None]

    def _send(self, what: str, source: FilesystemTier, offer: _Offer, side: _Side, pacer: Pacer) -> None:
        for name, size in offer.files:
            fd = None
            try:
                fd = open_part_file(source, offer.step, name)
            except OSError as exc:
                side.error = side.error or f"reading {source.step_dir(offer.step) / name}: {exc}"
            try:
                for at in range(0, size, CHUNK):
                    chunk = bytearray(min(CHUNK, size - at))
                    if fd is not None and side.error is None:
                        try:
                            got = os.preadv(fd, [chunk], at)
                            if got != len(chunk):
                                raise OSError(f"{got} bytes at offset {at}, expected {len(chunk)}")
                        except OSError as exc:
                            side.error = f"reading {source.step_dir(offer.step) / name}: {exc}"
                    tensor = torch.frombuffer(chunk, dtype=torch.uint8)
                    self._run(f"{what}: sending {name}", lambda t=tensor: dist.send(t, offer.to, group=self._pg))
                    pacer.wait(len(chunk))
            finally:
                if fd is not None:
                    os.close(fd)

    def _receive(
        self, what: str, tier: FilesystemTier, offer: _Offer, src: int, side: _Side, bound: FilesystemTier
    ) -> None:
        """Receive ``offer`` into ``tier`` (a place in ``bound``, the tier whose size bound it counts against)."""
        part = None
        arriving = f"node {offer.node}'s part of step {offer.step}"
        try:  # whatever fails here, every announced byte is still received below
            room = no_room_for(bound, self._config.tiers[bound.name], sum(size for _, size in offer.files), arriving)
            if room is not None:
                raise TierFullError(errno.ENOSPC, room)
            part = side.receiving = ReceivedPart(tier, offer.step, offer.node)
        except Exception as exc:
            side.error = f"receiving into {tier.root}: {type(exc).__name__}: {exc}"
        try:
            for name, size in offer.files:
                self._receive_file(what, part, name, size, src, side)
        except PeerLinkLost:
            if part is not None:
                part.abort()
            side.receiving = None
            raise
        if part is None:
            return
        if side.error is None:
            try:
                part.publish()
                return
            except Exception as exc:
                side.error = f"{type(exc).__name__}: {exc}"
        part.abort()
        side.receiving = None

    def _receive_file(self, what: str, part: ReceivedPart | None, name: str, size: int, src: int, side: _Side) -> None:
        """Every announced byte of ``name`` is received, whatever fails here (so the sender is never left
        waiting); it is written only while nothing has failed."""
        fd = None
        if part is not None and side.error is None:
            try:
                fd = part.open(name)
            except Exception as exc:
                side.error = f"receiving {name} into {part.partial}: {type(exc).__name__}: {exc}"
        try:
            for at in range(0, size, CHUNK):
                tensor = torch.empty(min(CHUNK, size - at), dtype=torch.uint8)
                self._run(f"{what}: receiving {name}", lambda t=tensor: dist.recv(t, src, group=self._pg))
                if side.error is not None or part is None:
                    continue
                try:
                    if fd is None:
                        part.manifest += tensor.numpy().tobytes()
                    else:
                        os.pwrite(fd, tensor.numpy().data, at)
                except OSError as exc:
                    side.error = f"writing {name} into {part.partial}: {exc}"
        finally:
            if fd is not None:
                os.close(fd)

    def _run(self, what: str, fn: Callable[[], T]) -> T:
        if self.broken is not None:
            raise PeerLinkLost(f"{what}: the peer group is unusable since {self.broken}")
        try:
            return fn()
        except Exception as exc:  # gloo: a dead peer, a timeout
            self.broken = f"{what} failed on rank {self._group.rank} ({type(exc).__name__}: {exc})"
            raise PeerLinkLost(f"{what}: lost the peer group: {type(exc).__name__}: {exc}") from exc

    # --- lifecycle -------------------------------------------------------------------------------
    def drain(self) -> list[FlushFailure]:
        """Wait for every queued transfer; the failures so far."""
        self._thread.submit(lambda: None).result()
        return list(self.failures)

    def close(self) -> None:
        self._thread.shutdown()
        if dist.is_initialized():
            dist.destroy_process_group(self._pg)


def _gather(group: dist.ProcessGroup, value: Any) -> list[Any]:
    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, value, group=group)
    return out


def _listed(tier: FilesystemTier) -> list[int]:
    try:
        return tier.steps()
    except OSError:
        return []


def _unsent(said: list[Any], tier: str, leaders: dict[str, int], nodes: list[str]) -> dict[int, list[str]]:
    """Per step, the nodes whose part of it on ``tier`` their partner does not keep, from what each rank
    said: (its steps on each tier, the steps it keeps on each tier for each other node)."""
    unsent: dict[int, list[str]] = {}
    for node, leader in leaders.items():
        kept = said[leaders[partner_of(nodes, node)]][1][tier].get(node, [])
        for step in said[leader][0][tier]:
            if step not in kept:
                unsent.setdefault(step, []).append(node)
    return unsent


def _newest_copy(held: dict[str, dict[str, list[int]]], node: str, own: list[int]) -> tuple[str, int] | None:
    """The (tier, step) a partner should send back to ``node``: its newest copy, if ``node`` lacks that step."""
    best = max(((steps[node][-1], name) for name, steps in held.items() if steps.get(node)), default=None)
    if best is None or best[0] in own:
        return None
    return best[1], best[0]


def _superseded(tier: FilesystemTier, step: int) -> bool:
    """Whether ``step`` has left ``tier`` for a newer one (retention keeps the newest): its copy is not
    needed, the newer step's follows. A step gone without a newer one is a loss, reported as such."""
    held = _listed(tier)
    return step not in held and any(newer > step for newer in held)


def _bandwidth(config: PipelineConfig, name: str) -> int | None:
    flush = config.tiers[name].flush
    return None if flush is None or flush.bandwidth is None else int(flush.bandwidth)
