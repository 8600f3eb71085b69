"""The machine's facts that make a result reproducible, its load, and the kernel knobs the probes turn."""

from __future__ import annotations

import os
import platform
import subprocess
import sys
from pathlib import Path

import torch

from .paths import BENCH_ROOT


def load_average() -> float:
    return os.getloadavg()[0]


def write_kernel_knob(path: str, value: str) -> bool:
    """Write ``value`` to a ``/proc`` file; False where the kernel refuses (not root, in a container)."""
    try:
        with open(path, "w") as f:
            f.write(value + "\n")
        return True
    except OSError:
        return False


def _output(cmd: list[str]) -> str:
    try:
        return subprocess.run(cmd, capture_output=True, text=True, check=False, timeout=10).stdout
    except (OSError, subprocess.TimeoutExpired):
        return ""


def machine_facts(directory: Path = BENCH_ROOT) -> dict[str, str]:
    """The facts RESULTS.md needs to make the numbers reproducible: CPU, memory, the disk of
    ``directory`` (where the checkpoints go), software."""
    lscpu = dict(
        (k.strip(), v.strip()) for k, _, v in (line.partition(":") for line in _output(["lscpu"]).splitlines()) if v
    )
    mem = _output(["free", "-g"]).splitlines()
    directory.mkdir(parents=True, exist_ok=True)
    df = _output(["df", "-hT", str(directory)]).splitlines()
    return {
        "cpu": f"{lscpu.get('Model name', platform.processor())}, {os.cpu_count()} cores "
        f"({lscpu.get('Hypervisor vendor', 'bare metal')})",
        "memory": mem[1] if len(mem) > 1 else "?",
        "disk": df[-1] if df else "?",
        "kernel": platform.release(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda or "none",
        "threads": str(torch.get_num_threads()),
        "load_avg_start": f"{load_average():.2f}",
    }


def warn_if_busy(limit: float = 1.5) -> None:
    load = load_average()
    if load > limit:
        print(f"warning: load average {load:.2f} > {limit}: other work is running, timings will be noisy",
              file=sys.stderr)


def start_run() -> dict[str, str]:
    """What every benchmark does first: warn when the machine is busy, then take its facts."""
    warn_if_busy()
    return machine_facts()
