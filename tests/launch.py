"""Launching test workers under torchrun, judged by what the workers wrote, not only by the exit code.

torch 2.13 with gloo on a CPU aborts now and then at process teardown ("terminate called without an
active exception", also with no tierstate code at all), after every scenario has run and recorded its
results. So each worker marks its end (:func:`mark_finished`, after its last scenario, before tearing
the process group down), and a launch whose exit code is that abort still passes when every rank
marked it; any other failure fails the test with the workers' output.

Launches that run side by side (:func:`run_side_by_side`: two ``torchrun --nnodes=2`` launches, or plain
rank processes) are judged the same way, with one more consequence of that abort: a torchrun agent whose
worker succeeded waits in torch's exit barrier (300 s) for every other agent, and an agent whose worker
failed never arrives there. So once a launch has ended in failure, each other launch is stopped as soon
as its worker has recorded its results, and judged by them. A launch still running at its timeout is
killed with every process under it (a hung worker too) and the test fails with every launch's output.
"""

from __future__ import annotations

import contextlib
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

TEARDOWN_ABORT = "terminate called without an active exception"


def _marker(workdir: Path, rank: int) -> Path:
    return workdir / f".finished-rank-{rank}"


def mark_finished(workdir: Path, rank: int) -> None:
    """In a worker: every scenario of this launch ran and recorded its results."""
    _marker(workdir, rank).touch()


def torchrun(worker: Path, workdir: Path, ranks: int, scenarios: tuple[str, ...], cwd: Path, timeout: float) -> None:
    """Run ``worker WORKDIR SCENARIOS...`` on ``ranks`` ranks (``--standalone``: a free port of its own),
    with this folder on the workers' ``PYTHONPATH`` (a worker in a subfolder imports :func:`mark_finished`)."""
    for rank in range(ranks):
        _marker(workdir, rank).unlink(missing_ok=True)
    command = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={ranks}",
        str(worker), str(workdir), *scenarios,
    ]  # fmt: skip
    helpers = os.pathsep.join([str(Path(__file__).parent), os.environ.get("PYTHONPATH", "")])  # this module too
    env = {**os.environ, "PYTHONPATH": helpers}
    (done,) = run_side_by_side([(command, env)], None, timeout, cwd, agents=True)  # a hung worker: killed too
    if done.returncode == 0:
        return
    finished = all(_marker(workdir, rank).exists() for rank in range(ranks))
    assert finished and TEARDOWN_ABORT in done.output, f"torchrun {' '.join(scenarios)} failed:\n{done.output[-9000:]}"


@dataclass
class Ended:
    """How one launch of :func:`run_side_by_side` ended."""

    returncode: int | None  # None: stopped after it recorded its results (see the module docstring)
    output: str  # stdout and stderr, interleaved
    recorded: bool  # its output has the worker's line saying its results are recorded
    agent: bool  # a torchrun agent: its worker's teardown abort makes it exit 1, a plain process dies by SIGABRT

    @property
    def succeeded(self) -> bool:
        """It recorded its results and ended well, at torch's teardown abort, or stopped in the exit barrier."""
        aborted = self.returncode == (1 if self.agent else -signal.SIGABRT) and TEARDOWN_ABORT in self.output
        return self.recorded and (self.returncode in (0, None) or aborted)


def _descendants(pid: int) -> list[int]:
    """The processes under ``pid``, children first (Linux's /proc children lists; gone ones skipped)."""
    found = []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        with contextlib.suppress(OSError):
            found += [int(child) for child in (task / "children").read_text().split()]
    return [grand for child in found for grand in (child, *_descendants(child))]


class _Launch:
    """One process of a side-by-side run (a session of its own, so that its workers are stopped with it),
    its output read by a thread as it comes."""

    def __init__(
        self, command: list[str], env: dict[str, str], cwd: Path | None, marker: str | None, ended: queue.Queue
    ) -> None:
        self.proc = subprocess.Popen(
            command, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
            start_new_session=True,
        )  # fmt: skip
        self.lines: list[str] = []
        self.recorded = threading.Event()
        self.stopped = False
        self._reader = threading.Thread(target=self._read, args=(marker, ended), daemon=True)
        self._reader.start()

    def _read(self, marker: str | None, ended: queue.Queue) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.append(line)
            if marker is not None and marker in line:
                self.recorded.set()
        self.proc.wait()
        ended.put(self)

    def stop(self) -> None:
        """SIGKILL the launch and every process under it (torchrun starts each worker in a session of its
        own: killing the agent's group alone would leave a hung worker running into later tests)."""
        if self.proc.poll() is None:
            self.stopped = True
            for pid in [self.proc.pid, *_descendants(self.proc.pid)]:
                with contextlib.suppress(ProcessLookupError):  # it ended meanwhile
                    os.kill(pid, signal.SIGKILL)

    def result(self, agent: bool) -> Ended:
        self._reader.join()
        returncode = None if self.stopped else self.proc.returncode
        return Ended(returncode, "".join(self.lines), self.recorded.is_set(), agent)


def run_side_by_side(
    commands: list[tuple[list[str], dict[str, str]]],
    marker: str | None,
    timeout: float,
    cwd: Path | None = None,
    agents: bool = False,
) -> list[Ended]:
    """Run ``(command, environment)`` pairs at once until all end; ``marker``: the line a worker prints once
    its results are recorded (None: the workers mark that otherwise, see :func:`mark_finished`);
    ``agents``: the commands are torchrun agents, which wait for each other in torch's exit barrier.
    Past ``timeout`` every launch is stopped and the test fails with all outputs."""
    ended: queue.Queue[_Launch] = queue.Queue()
    launches = [_Launch(command, env, cwd, marker, ended) for command, env in commands]
    end = time.monotonic() + timeout
    for _ in launches:
        try:
            first = ended.get(timeout=max(0.0, end - time.monotonic()))
        except queue.Empty:
            break
        if agents and first.proc.returncode != 0:  # the others would wait for it in the exit barrier
            for other in launches:
                if other.proc.poll() is None and other.recorded.wait(max(0.0, end - time.monotonic())):
                    other.stop()
    late = [i for i, launch in enumerate(launches) if launch.proc.poll() is None]
    for launch in launches:
        launch.stop()
    results = [launch.result(agents) for launch in launches]
    if late:
        outputs = "\n".join(f"--- launch {i}:\n{r.output[-6000:]}" for i, r in enumerate(results))
        raise AssertionError(f"launch(es) {late} still running after {timeout:.0f} s:\n{outputs}")
    return results


def process_gone(pid: int, within: float) -> bool:
    """Whether process ``pid`` ends within ``within`` seconds (it is no child of ours: its pid is watched; a
    zombie its reaper has not collected yet has ended)."""
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0]
        except FileNotFoundError:
            return True
        if state in ("Z", "X"):
            return True
        time.sleep(0.05)  # polling another process's end: there is nothing of ours to wait on
    return False
