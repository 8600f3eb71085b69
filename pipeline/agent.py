"""The node agent: a process per node that flushes the persist tier's checkpoints on along the flush graph,
applies retention, and outlives the trainer.

Flushes out of host memory run in the trainer's process today, on the cores and under the GIL the
trainer needs, and die with it: a SIGKILLed trainer's committed memory checkpoints wait for a restart to
reach NVMe or the PFS. With ``agent: {enabled: true}`` they run in a separate process instead, one per
node, started by the first runner of the node (``tierstate agent --config FILE``, in a session of its
own, so the trainer's death or its process group's signal does not take it along; a launcher may start
it itself the same way). It is niced, paces each target to its flush ``bandwidth``, copies through the
same code as ``tierstate flush`` (:func:`tiers.ops.pending.flush_pending`: each pending step from the
copy nearest its target, verified, receipts in every copy) and prunes every tier by its retention.

Its files live in the persist tier's directory, under ``.agent/`` (node-scoped: one per node):

- ``lock``: held (``flock``) by the running agent, with its pid: two agents on one node never run at
  once, so no step is flushed twice by them (a second one started exits at once);
- ``config.json``: the config it runs (written by the runner that starts it, holding ``starting``: the
  ranks of a node start their runners at once, and one of them starts the agent);
- ``trainers/<pid>``: one per attached runner, removed by ``close()``; a file whose process is gone is
  a trainer that died;
- ``log``: what it did and why it stopped.

It exits by itself once no trainer is attached (none alive) and nothing is left to flush, so a job's
end leaves no process behind; a runner that finds it dead at a commit starts it again. Runners of an
agent's node do not copy: their flusher waits for each copy to appear on its tier (the handle's
futures resolve then, and ``close()`` drains as before: every flush done, or reported failed after
``group_timeout`` seconds).
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from tierstate.errors import TierstateError

from ..tiers.ops.pacing import Pacer
from ..tiers.ops.pending import FlushOutcome, flush_pending
from ..tiers.ops.retention import BucketPolicies, TierPolicies, graph_of
from ..tiers.storage.filesystem import FilesystemTier
from ..tiers.storage.locks import still_there
from ..tiers.storage.safeopen import make_dir, open_or_create, write_durably
from .buckets import open_buckets
from .config import PipelineConfig, parse_config
from .flush import FlushFailure
from .handle import HandleCompleter

log = logging.getLogger("tierstate.agent")

AGENT_DIR = ".agent"
POLL_MAX = 1.0  # seconds between looks when idle: a checkpoint's commit is seen within this
START_S = 60.0  # a new agent process imports (torch among others) before it takes its lock


@dataclass(frozen=True)
class AgentFiles:
    """The agent's files in the persist tier's directory of this node."""

    root: Path

    @classmethod
    def of(cls, config: PipelineConfig) -> AgentFiles:
        return cls(Path(config.tiers[config.persist_tier].path) / AGENT_DIR)

    @property
    def lock(self) -> Path:
        return self.root / "lock"

    @property
    def config(self) -> Path:
        return self.root / "config.json"

    @property
    def trainers(self) -> Path:
        return self.root / "trainers"

    @property
    def starting(self) -> Path:
        """Locked by the runner that starts the agent, while it does."""
        return self.root / "starting"

    @property
    def log(self) -> Path:
        return self.root / "log"

    @property
    def closed(self) -> Path:
        """Written by each runner that closes: its time says a crash's restart came and ended cleanly."""
        return self.root / "closed"

    def make(self) -> None:
        make_dir(self.root)
        make_dir(self.trainers)


def attach(files: AgentFiles, pid: int | None = None) -> None:
    """Say that the runner of process ``pid`` (this one) is attached: the agent stays while it lives."""
    write_durably(files.trainers / str(pid or os.getpid()), b"")


def detach(files: AgentFiles, pid: int | None = None) -> None:
    with contextlib.suppress(FileNotFoundError):
        os.unlink(files.trainers / str(pid or os.getpid()))


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # another user's process has that pid: taken as alive, the safe side
    return True


def _attached(files: AgentFiles) -> list[int]:
    """The pids of the runners that said they are attached, alive or not."""
    try:
        return sorted(int(name) for name in os.listdir(files.trainers) if name.isdigit())
    except FileNotFoundError:
        return []


def trainers_alive(files: AgentFiles) -> tuple[list[int], int]:
    """The attached runners' processes that still live, and how many died attached (their runner never closed:
    a crash, which a restart may follow); the files of the dead are removed."""
    alive, died = [], 0
    for pid in _attached(files):
        if _alive(pid):
            alive.append(pid)
        else:
            detach(files, pid)
            died += 1
    return alive, died


def agent_status(tier_root: Path) -> str | None:
    """What ``tierstate ls`` says of the agent of the persist tier at ``tier_root`` (reading only): running or
    not, and the live trainers attached; None where no agent ever ran."""
    files = AgentFiles(tier_root / AGENT_DIR)
    if not files.root.is_dir():
        return None
    pid, trainers = agent_pid(files), [p for p in _attached(files) if _alive(p)]
    attached = f"{len(trainers)} trainer(s) attached" + (f" (pids {', '.join(map(str, trainers))})" if trainers else "")
    return f"{'running (pid ' + str(pid) + ')' if pid is not None else 'not running'}, {attached}; log {files.log}"


@contextlib.contextmanager
def agent_lock(files: AgentFiles) -> Iterator[int | None]:
    """Hold the node's agent lock while the block runs, writing this pid into it: the lock file's descriptor,
    or None (held by no one here) if another agent holds it."""
    fd = open_or_create(files.lock, os.O_RDWR)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            yield None
            return
        os.ftruncate(fd, 0)
        os.pwrite(fd, str(os.getpid()).encode(), 0)
        yield fd
    finally:
        os.close(fd)


def agent_pid(files: AgentFiles) -> int | None:
    """The pid of the agent running on this node, or None if none runs (its lock is free)."""
    try:
        fd = os.open(files.lock, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except FileNotFoundError:
        return None
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            text = os.pread(fd, 32, 0).decode(errors="replace").strip()
            return int(text) if text.isdigit() else -1  # held, its pid not written yet
        fcntl.flock(fd, fcntl.LOCK_UN)
        return None
    finally:
        os.close(fd)


# Starts argv[1:] in a new session with this process's stdin, stdout and stderr, and exits.
_LAUNCH = "import subprocess, sys; subprocess.Popen(sys.argv[1:], start_new_session=True, close_fds=False)"


class AgentError(TierstateError, RuntimeError):
    """The node agent could not be started; names its log."""


def start_agent(config: PipelineConfig, within: float = START_S) -> int:
    """Write ``config`` for the agent and start ``tierstate agent`` in a session of its own (so that it
    outlives this process and its process group), unless one runs on this node already; its pid, once it
    holds the node's agent lock. AgentError if it ends first or takes longer than ``within`` seconds."""
    files = AgentFiles.of(config)
    files.make()
    with _starting(files):
        running = agent_pid(files)
        return running if running is not None else _launch(config, files, within)


@contextlib.contextmanager
def _starting(files: AgentFiles) -> Iterator[None]:
    """One runner of the node at a time starts the agent (the ranks of a node build their runners at once: each
    would write its config and launch one); the next finds it running."""
    fd = open_or_create(files.starting, os.O_RDWR)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)  # held for at most one agent's start (``within`` seconds)
        yield
    finally:
        os.close(fd)


def _launch(config: PipelineConfig, files: AgentFiles, within: float) -> int:
    write_durably(files.config, json.dumps(config.model_dump(mode="json", by_alias=True)).encode())
    out = os.open(files.log, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
    try:
        # Started through a launcher that exits at once: the agent is no child of the trainer (which neither
        # reaps it nor takes it along), and runs in a session of its own (no signal to the trainer's group).
        subprocess.run(
            [sys.executable, "-c", _LAUNCH, sys.executable, "-m", "tierstate", "agent", "--config", str(files.config)],
            stdin=subprocess.DEVNULL, stdout=out, stderr=out, close_fds=True, check=True, timeout=within,
        )  # fmt: skip
    except (subprocess.CalledProcessError, subprocess.TimeoutExpired) as exc:
        raise AgentError(f"the node agent of tier {config.persist_tier} could not be launched ({exc}): "
                         f"see {files.log}") from None  # fmt: skip
    finally:
        os.close(out)
    deadline = time.monotonic() + within
    while (pid := agent_pid(files)) is None or pid < 0:
        if time.monotonic() > deadline:
            where = f"tier {config.persist_tier}"
            raise AgentError(f"the node agent of {where} did not start in {within:g} s: see {files.log}")
        time.sleep(0.02)  # the new process imports and takes its lock: nothing of ours to wait on
    log.info("node agent %d runs for tier %s (%s)", pid, config.persist_tier, files.root)
    return pid


class AgentLink:
    """A runner's side of its node's agent, an after-commit listener (pipeline/aftercommit.py): attaches the
    runner and starts the agent when built, starts it again at a commit that finds it dead, detaches at close."""

    def __init__(self, config: PipelineConfig) -> None:
        self._config = config
        self._files = AgentFiles.of(config)
        self._files.make()
        attach(self._files)
        try:
            start_agent(config)
        except BaseException:
            detach(self._files)
            raise

    @classmethod
    def started(cls, config: PipelineConfig) -> AgentLink | None:
        """The link to this node's agent, started if none runs; None (logged) when it cannot run: the
        runner then flushes in its own process, as without an agent."""
        try:
            return cls(config)
        except (AgentError, OSError) as exc:
            log.error("no node agent (%s: %s): flushing in the trainer's process instead", type(exc).__name__, exc)
            return None

    def committed(self, completer: HandleCompleter) -> None:  # noqa: ARG002 - the protocol's signature
        self._running()

    def drain(self) -> list[FlushFailure]:
        """Before the flusher waits for the agent's copies (it drains next): an agent that died since the last
        commit is started again, or that wait would last its whole timeout."""
        try:
            self._running()
        except (AgentError, OSError) as exc:
            log.error("the node agent could not be started again (%s): the flusher reports what is missing", exc)
        return []  # the flusher waits for the agent's copies and reports what did not come

    def _running(self) -> None:
        if agent_pid(self._files) is None:
            log.warning("the node agent of tier %s is not running: starting it again", self._config.persist_tier)
            start_agent(self._config)

    def close(self) -> None:
        detach(self._files)
        # Its time is what counts: touched in place, as the ranks of a node close at once (a write through a
        # temporary name would race over that one name).
        fd = open_or_create(self._files.closed, os.O_WRONLY)
        try:
            os.utime(fd)
        finally:
            os.close(fd)


def _logged(outcome: FlushOutcome) -> None:
    """One line in the agent's log per copy: what went where, how fast, or why not."""
    where = f"step {outcome.step}: {outcome.source} -> {outcome.target}"
    if outcome.report is not None:
        report = outcome.report
        log.info("%s: %s, %d bytes in %.3f s", where, report.outcome, report.bytes_copied, report.seconds)
    else:
        log.error("%s: %s", where, outcome.error)


def _closed_after(files: AgentFiles, moment: float) -> bool:
    """Whether a runner closed after ``moment`` (wall clock, as file times are): a restart that came and went
    between two looks of the agent."""
    try:
        return os.stat(files.closed).st_mtime > moment
    except FileNotFoundError:
        return False


def load_agent_config(path: Path) -> PipelineConfig:
    return parse_config(json.loads(path.read_text()), source=str(path))


def run_agent(config: PipelineConfig, poll_max: float = POLL_MAX) -> int:
    """The agent's loop (``tierstate agent``): flush what is pending, prune, look again; until no trainer is
    attached and nothing is left, and ``agent.linger`` seconds have passed since a trainer was last found dead
    (its restart reattaches meanwhile). Exit code 0, also when another agent runs on this node already."""
    files = AgentFiles.of(config)
    files.make()
    with agent_lock(files) as mine:
        if mine is None:
            log.info("an agent runs on this node already (pid %s): leaving the flushes to it", agent_pid(files))
            return 0
        with contextlib.suppress(OSError):
            os.nice(config.agent.nice)  # the trainer's cores come first
        tiers = [
            TierPolicies(FilesystemTier(name, spec.path, spec.scope), spec.retention, spec.flush)
            for name, spec in config.tiers.items()
        ]
        buckets = [
            BucketPolicies(b, config.buckets[b.name].retention, config.buckets[b.name].flush)
            for b in open_buckets(config)
            if b.name != config.persist_bucket
        ]
        graph = graph_of(tiers, [(b.tier.name, b.flush) for b in buckets])
        pacers = {edge.target: Pacer(edge.policy.bandwidth) for edge in graph.edges}
        pause, crashed = 0.02, float("-inf")  # when a trainer was last found dead (wall clock: see _closed_after)
        while True:
            if not still_there(files.lock, mine):
                # The tier's directory was removed (or its agent files replaced): what this agent would copy
                # and prune is no longer its node's, and a new runner there starts an agent of its own.
                log.info("the agent's lock %s is gone or replaced: the agent stops", files.lock)
                return 0
            run = flush_pending(tiers, buckets, pacers, _logged)
            done = any(o.error is None for o in run.outcomes) or any(d.delete for d in run.pruned)
            alive, died = trainers_alive(files)
            if died:
                crashed = time.time()
                log.info("%d trainer(s) died attached: waiting up to %g s for a restart", died, config.agent.linger)
            elif alive or _closed_after(files, crashed):
                crashed = float("-inf")  # restarted since (or never crashed): it ends with its trainers, as usual
            if not done and not alive and time.time() - crashed >= config.agent.linger:
                # Nothing moved this pass and no trainer is left: whatever failed is left pending (marked by
                # ls), for the next run's agent or runner, or tierstate flush.
                left = sum(o.error is not None for o in run.outcomes)
                status = f"{left} flush(es) failing" if left else "all done"
                log.info("no trainer attached, %s: the agent stops", status)
                return 0
            pause = 0.02 if done else min(poll_max, pause * 2)
            time.sleep(pause)  # nothing to wait on: the trainers commit on their own schedule
