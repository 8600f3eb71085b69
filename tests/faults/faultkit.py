"""Shared parts of the fault-injection suite: a trainer whose state at every step is known, a check
that finds every lost or wrong checkpoint, real-fault helpers (mounts), and the trial budget.

The state at step ``s`` is a pure function of ``s`` (:func:`expected`), so after any fault the
suite can say, for every committed checkpoint, whether it holds exactly the bytes of its step.
``TIERSTATE_FAULT_TRIALS`` (default 24) is the suite's budget: every trial and fuzz count is
proportional to it (24: 36 kill trials, 5000 fuzz inputs). ``TIERSTATE_FAULT_TALLY=FILE`` appends
one JSON line of counts per test to FILE, for the summary of a long run.
"""

from __future__ import annotations

import ctypes
import json
import multiprocessing
import multiprocessing.connection
import multiprocessing.forkserver
import os
import subprocess
import sys
import time
from collections.abc import Iterable, Iterator, Mapping
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import torch

from tierstate.pipeline.runner import Runner
from tierstate.providers import ObjectProvider
from tierstate.providers.items import TensorItem
from tierstate.tiers.reading.stored import StoredCheckpoint
from tierstate.tiers.storage import faults
from tierstate.tiers.storage.filesystem import FilesystemTier

REPO = Path(__file__).resolve().parents[2]
DEFAULT_YAML = REPO / "configs" / "default.yaml"
TRIALS = int(os.environ.get("TIERSTATE_FAULT_TRIALS", "24"))
TIER_NAMES = ("nvme", "pfs")


def scaled(base: int) -> int:
    """``base`` at the default budget, proportionally more (or fewer, at least 1) with TIERSTATE_FAULT_TRIALS."""
    return max(1, base * TRIALS // 24)


def tally(test: str, **counts: int) -> None:
    """Record what a test did (trials, faults, inputs, losses) for the suite's summary."""
    path = os.environ.get("TIERSTATE_FAULT_TALLY")
    if path:
        with open(path, "a") as out:
            out.write(json.dumps({"test": test, **counts}) + "\n")


# --- the trainer's state ----------------------------------------------------------------------


def expected(step: int) -> dict[str, torch.Tensor]:
    """The tensors at ``step``: ~3.8 MiB in four dtypes, four 1 MiB frames, the first one compressible."""
    g = torch.Generator().manual_seed(step)
    return {
        "c": torch.full((256 * 1024,), float(step)),
        "w": torch.randn(640 * 1024, generator=g),
        "h": torch.randn(96 * 1024, generator=g).to(torch.bfloat16),
        "i": torch.randint(-(2**62), 2**62, (1000,), generator=g, dtype=torch.int64),
        "e": torch.empty(0, 3),
    }


class StepState:
    """The trainer's state, changed in place each step as an optimizer would."""

    def __init__(self) -> None:
        self.tensors = expected(0)
        self.counters: dict[str, Any] = {"step": 0}

    def advance(self, step: int) -> None:
        for key, value in expected(step).items():
            self.tensors[key].copy_(value)
        self.counters["step"] = step

    def describe(self) -> list[TensorItem]:
        return [TensorItem(key, t) for key, t in self.tensors.items()]

    def restore(self, state: Mapping[str, Any]) -> None:
        for key, t in self.tensors.items():
            t.copy_(state[key])

    def register(self, runner: Runner) -> None:
        runner.register(t=self, meta=ObjectProvider(self.counters))


def same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit equality, NaN payloads and signed zeros included."""
    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(a.view(torch.uint8), b.view(torch.uint8))


def matches_step(state: Mapping[str, Any], step: int) -> bool:
    want = expected(step)
    return all(same_bytes(state[f"t/{k}"], v) for k, v in want.items()) and state["meta/value"] == {"step": step}


def tiers_of(root: Path) -> list[FilesystemTier]:
    return [FilesystemTier(name, root / name) for name in TIER_NAMES]


def overrides(root: Path, **extra: Any) -> dict[str, Any]:
    """Small chunks and cache, so the state is several frames through a 4-slab cache."""
    return {
        "tiers": {name: {"path": str(root / name)} for name in TIER_NAMES},
        "chunk_size": "1MiB",
        "host_cache.size": "4MiB",
        **{key.replace("__", "."): value for key, value in extra.items()},
    }


def make_runner(root: Path, **extra: Any) -> Runner:
    return Runner.from_yaml(DEFAULT_YAML, overrides(root, **extra))


@contextmanager
def trainer(root: Path, **extra: Any) -> Iterator[tuple[Runner, StepState]]:
    """A runner on ``root``'s tiers with the known state registered (at step 0), closed after the block."""
    runner = make_runner(root, **extra)
    state = StepState()
    state.register(runner)
    try:
        yield runner, state
    finally:
        runner.close()


def write_steps(root: Path, steps: Iterable[int], **extra: Any) -> None:
    """Commit ``steps`` of the known state in-process."""
    with trainer(root, **extra) as (runner, state):
        for step in steps:
            state.advance(step)
            runner.checkpoint(step).result()


def state_matches(state: StepState, step: int) -> bool:
    """Whether the live state (after a restore) is bit for bit the state of ``step``."""
    return matches_step({f"t/{k}": v for k, v in state.tensors.items()} | {"meta/value": state.counters}, step)


@dataclass
class Audit:
    """What is on the tiers after a fault: committed steps, partial leftovers, and losses."""

    steps: list[int]
    partials: list[str]
    losses: list[str] = field(default_factory=list)


def audit(root: Path) -> Audit:
    """Read back every committed checkpoint on every tier; any that is not bit-exact is a loss."""
    return audit_tiers(tiers_of(root))


def audit_tiers(tiers: Iterable[FilesystemTier]) -> Audit:
    """:func:`audit` of the given tiers."""
    steps: set[int] = set()
    partials: list[str] = []
    losses: list[str] = []
    for tier in tiers:
        partials += [p.name for p in tier.partials()]
        for step in tier.steps():
            steps.add(step)
            try:
                state = StoredCheckpoint(tier.step_dir(step)).read()
            except Exception as exc:  # any failure to read a committed checkpoint is a loss
                losses.append(f"{tier.name} step {step}: {type(exc).__name__}: {exc}")
                continue
            if not matches_step(state, step):
                losses.append(f"{tier.name} step {step}: bytes differ from the state of step {step}")
    return Audit(sorted(steps), sorted(partials), losses)


# --- the trainer process -----------------------------------------------------------------------


def train(
    root: str,
    first: int,
    count: int,
    fault: str | None,
    conn: multiprocessing.connection.Connection,
    extra: Mapping[str, Any],
    env: Mapping[str, str] | None = None,
) -> None:
    """Checkpoint steps ``first .. first+count-1``, reporting each request and each durable step.

    Runs in a child process; ``fault`` (``POINT@N``) makes it SIGKILL itself at that fault point;
    ``extra`` are config overrides (flush and retention policies); ``env`` is set in the child (the
    forkserver's own environment is the one it started with, not the test's now: S3 credentials).
    The state changes only after capture, as with the optimizer pre-hook of ``runner.attach``.
    """
    os.environ.update(env or {})
    if fault:
        os.environ[faults.ENV] = fault
    runner = make_runner(Path(root), pipeline__stages__persist__bandwidth="48MiB", **extra)
    state = StepState()
    state.register(runner)
    pending = None
    for step in range(first, first + count):
        state.advance(step)
        handle = runner.checkpoint(step)  # policy wait: returns once the previous one is done
        if pending is not None and pending.error is None:
            conn.send(("durable", pending.step))
        conn.send(("requested", step))
        runner.wait_captured()
        pending = handle
    if pending is not None and pending.wait() and pending.error is None:
        conn.send(("durable", pending.step))
    runner.close()


_context: multiprocessing.context.BaseContext | None = None


def trainer_context() -> multiprocessing.context.BaseContext:
    """A forkserver that has imported torch and tierstate once, so a trial costs a fork, not an import."""
    global _context
    if _context is None:
        _context = multiprocessing.get_context("forkserver")
        _context.set_forkserver_preload(["faultkit"])
        # The server ignores our sys.path when it preloads (CPython passes it but never applies it),
        # so it is told where faultkit is through its environment, only while starting.
        saved = os.environ.get("PYTHONPATH")
        os.environ["PYTHONPATH"] = os.pathsep.join([str(Path(__file__).parent), *filter(None, [saved])])
        try:
            multiprocessing.forkserver.ensure_running()
        finally:
            if saved is None:
                del os.environ["PYTHONPATH"]
            else:
                os.environ["PYTHONPATH"] = saved
    return _context


@dataclass
class Trial:
    requested: list[int]
    durable: list[int]
    exitcode: int | None


def run_trainer(
    root: Path,
    first: int,
    count: int,
    fault: str | None = None,
    kill_after: float | None = None,
    extra: Mapping[str, Any] | None = None,
    env: Mapping[str, str] | None = None,
) -> Trial:
    """Run :func:`train` in a child; with ``kill_after``, SIGKILL it that many seconds after its first request."""
    ctx = trainer_context()
    ours, theirs = ctx.Pipe(duplex=False)
    child = ctx.Process(target=train, args=(str(root), first, count, fault, theirs, dict(extra or {}), dict(env or {})))
    child.start()
    theirs.close()
    requested: list[int] = []
    durable: list[int] = []
    deadline: float | None = None
    while True:
        if deadline is not None and not ours.poll(max(0.0, deadline - time.monotonic())):
            child.kill()  # the random moment has come, whatever the trainer is doing
            deadline = None
            continue
        try:
            kind, step = ours.recv()
        except EOFError:
            break
        if kind == "requested":
            requested.append(step)
            if kill_after is not None and len(requested) == 1:
                deadline = time.monotonic() + kill_after
        elif kind == "durable":
            durable.append(step)
    child.join()
    ours.close()
    return Trial(requested, durable, child.exitcode)


# --- real faults that need privileges ------------------------------------------------------------


def _mount(*args: str) -> None:
    subprocess.run(["mount", *args], check=True, capture_output=True)


def _umount(path: Path) -> None:
    subprocess.run(["umount", "-l", str(path)], check=False, capture_output=True)


@contextmanager
def _mounted(path: Path, what: str, *args: str) -> Iterator[Path]:
    """``mount ARGS PATH`` for the block, unmounted after; skips the test where mounting is not permitted."""
    path.mkdir(parents=True, exist_ok=True)
    try:
        _mount(*args, str(path))
    except (OSError, subprocess.CalledProcessError) as exc:
        pytest.skip(f"cannot mount {what} here: {exc}")
    try:
        yield path
    finally:
        _umount(path)


def tmpfs(path: Path, size: str) -> AbstractContextManager[Path]:
    """A real, small file system at ``path``: ENOSPC from the kernel once it is full."""
    return _mounted(path, "a tmpfs", "-t", "tmpfs", "-o", f"size={size}", "tmpfs")


def bind(path: Path) -> AbstractContextManager[Path]:
    """``path`` bind-mounted onto itself, so :func:`set_read_only` can flip it."""
    return _mounted(path, "a bind mount", "--bind", str(path))


def set_read_only(path: Path, read_only: bool) -> None:
    """Remount a :func:`bind` mount read-only or read-write: refused even to root, unlike chmod."""
    _mount("-o", f"remount,bind,{'ro' if read_only else 'rw'}", str(path))


# --- process resources ----------------------------------------------------------------------------


def rss_bytes() -> int:
    """Resident set size of this process, from /proc (what the kernel charges it, not what Python thinks).

    glibc's malloc first gives back what it keeps of freed blocks: the copies a checkpoint makes before
    returning are freed on another thread and may sit in an arena for a while, which is no leak.
    """
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def snapshot(directory: Path) -> dict[str, bytes]:
    """Every file of a checkpoint directory, to show it is untouched byte for byte."""
    return {p.name: p.read_bytes() for p in sorted(directory.iterdir())}


def forget_close(root: str, hard_exit: bool) -> None:
    """A trainer that never calls close(): commits step 1, requests step 2, and exits at once.

    ``hard_exit`` leaves by ``os._exit`` (no atexit handlers: as abrupt as a crash, minus the signal);
    otherwise by returning, so the interpreter shuts down normally.
    """
    runner = make_runner(Path(root), pipeline__stages__persist__bandwidth="32MiB")
    state = StepState()
    state.register(runner)
    state.advance(1)
    runner.checkpoint(1).result()
    state.advance(2)
    runner.checkpoint(2)
    runner.wait_captured()
    if hard_exit:
        os._exit(0)


def run_forgetful(root: Path, hard_exit: bool) -> int:
    """:func:`forget_close` in a fresh interpreter (a fork would skip the interpreter's own shutdown)."""
    path = os.pathsep.join([str(Path(__file__).parent), *filter(None, [os.environ.get("PYTHONPATH")])])
    env = {**os.environ, "PYTHONPATH": path}
    code = f"import faultkit; faultkit.forget_close({str(root)!r}, {hard_exit})"
    return subprocess.run([sys.executable, "-c", code], env=env, cwd=REPO, timeout=120).returncode
