"""Launching test workers under torchrun, judged by what the workers wrote, not only by the exit code.

torch 2.13 with gloo on a CPU aborts now and then at process teardown ("terminate called without an
active exception", also with no tierstate code at all), after every scenario has run and recorded its
results. So each worker marks its end (:func:`mark_finished`, after its last scenario, before tearing
the process group down), and a launch whose exit code is that abort still passes when every rank
marked it; any other failure fails the test with the workers' output.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

TEARDOWN_ABORT = "terminate called without an active exception"


def _marker(workdir: Path, rank: int) -> Path:
    return workdir / f".finished-rank-{rank}"


def mark_finished(workdir: Path, rank: int) -> None:
    """In a worker: every scenario of this launch ran and recorded its results."""
    _marker(workdir, rank).touch()


def torchrun(worker: Path, workdir: Path, ranks: int, scenarios: tuple[str, ...], cwd: Path, timeout: float) -> None:
    """Run ``worker WORKDIR SCENARIOS...`` on ``ranks`` ranks (``--standalone``: a free port of its own)."""
    for rank in range(ranks):
        _marker(workdir, rank).unlink(missing_ok=True)
    command = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={ranks}",
        str(worker), str(workdir), *scenarios,
    ]  # fmt: skip
    done = subprocess.run(command, cwd=cwd, capture_output=True, text=True, timeout=timeout)
    output = f"{done.stdout[-3000:]}{done.stderr[-6000:]}"
    if done.returncode == 0:
        return
    finished = all(_marker(workdir, rank).exists() for rank in range(ranks))
    assert finished and TEARDOWN_ABORT in done.stdout + done.stderr, f"torchrun {' '.join(scenarios)} failed:\n{output}"
