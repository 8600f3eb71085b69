"""The node agent after a SIGKILL: how soon a dead trainer's committed memory checkpoints reach NVMe, against
how long their flushes take normally, in the same run.

1. Normal: a runner with no agent checkpoints the state into the memory tier ``--steps`` times; each
   checkpoint's flush time is from durable in memory to published on NVMe (its handle's futures).
2. Killed: a trainer process with the agent on checkpoints the same state ``--steps`` times as fast as
   the memory tier takes them, then is SIGKILLed at once; the clock runs from the kill until every step
   it reported durable is on NVMe, flushed by the agent with no restart.

The ratio divides (2) by the same time for the runner's own flushes of the same checkpoints, committed
the same way: from the last commit until every one is on NVMe. The target of issue 38 is <= 2.

    python benchmarks/agent.py --mib 256 --steps 4 --repeats 3
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from tierstate import Runner, TensorDictProvider
from tierstate.tiers.storage.filesystem import FilesystemTier

REPO = Path(__file__).resolve().parents[1]

_TRAINER = """
import json, sys, time, torch
from tierstate import Runner, TensorDictProvider
runner = Runner.from_dict(json.loads(open(sys.argv[1]).read()))
state = {"w": torch.zeros(int(sys.argv[2]) << 18)}
runner.register(model=TensorDictProvider(state))
for step in range(1, int(sys.argv[3]) + 1):
    state["w"].fill_(step)
    runner.checkpoint(step).result()
    print(step, time.time(), flush=True)
sys.stdin.read()
"""


def _layout(root: Path, shm: Path, agent: bool, mib: int, nice: int = 10) -> dict[str, Any]:
    return {
        "tiers": {
            "memory": {"kind": "memory", "path": str(shm), "size": f"{4 * mib + 64}MiB", "retention": {"keep_last": 2}},
            "nvme": {"path": str(root / "nvme"), "flush": {"every": 1}, "retention": {"keep_last": 8}},
        },
        "chunk_size": "16MiB", "host_cache": {"size": "256MiB"}, "agent": {"enabled": agent, "nice": nice},
    }  # fmt: skip


def normal_flushes(root: Path, shm: Path, mib: int, steps: int) -> tuple[float, int]:
    """The same checkpoints flushed by the runner itself (no agent), committed as fast as the memory tier
    takes them: seconds from the last one durable until every one is on NVMe, and how many were not there
    then."""
    runner = Runner.from_dict(_layout(root, shm, agent=False, mib=mib))
    state = {"w": torch.zeros(mib << 18)}
    runner.register(model=TensorDictProvider(state))
    handles = []
    for step in range(1, steps + 1):
        state["w"].fill_(step)
        handles.append(runner.checkpoint(step))
        handles[-1].result()
    last = time.perf_counter()
    behind = sum(not h.persisted("nvme") for h in handles)
    for handle in handles:
        handle.tier_futures["nvme"].result()
    seconds = time.perf_counter() - last
    runner.close()
    return seconds, behind


def killed(root: Path, shm: Path, mib: int, steps: int, nice: int) -> tuple[float, list[int], list[float]]:
    """Seconds from the SIGKILL until every step the trainer reported durable is on NVMe; the steps that
    were not there at the kill; the seconds of each copy the agent logged."""
    root.mkdir(parents=True, exist_ok=True)
    config = root / "layout.json"
    config.write_text(json.dumps(_layout(root, shm, agent=True, mib=mib, nice=nice)))
    trainer = subprocess.Popen(
        [sys.executable, "-c", _TRAINER, str(config), str(mib), str(steps)], cwd=REPO, stdin=subprocess.PIPE,
        stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    assert trainer.stdout is not None
    durable = [int(trainer.stdout.readline().split()[0]) for _ in range(steps)]
    trainer.send_signal(signal.SIGKILL)
    killed_at = time.perf_counter()
    trainer.wait()
    nvme = FilesystemTier("nvme", root / "nvme")
    behind = [step for step in durable if step not in nvme.steps()]
    while not set(durable) <= set(nvme.steps()):
        time.sleep(0.005)  # the agent is another process: its progress is only seen on the tier
    seconds = time.perf_counter() - killed_at
    logged = (shm / ".agent" / "log").read_text()
    copies = [float(m) for m in re.findall(r"memory -> nvme: copied, \d+ bytes in ([\d.]+) s", logged)]
    return seconds, behind, copies


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mib", type=int, default=256, help="state size in MiB")
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--shm", default="/dev/shm", help="the tmpfs of the memory tier")
    parser.add_argument("--nice", type=int, default=10, help="the agent's agent.nice (other jobs on the machine "
                        "take a niced agent's CPU, as the trainer would)")  # fmt: skip
    args = parser.parse_args()
    rows = []
    for round_ in range(args.repeats):
        root = Path(tempfile.mkdtemp(prefix="tierstate-agent-", dir=os.environ.get("TMPDIR")))
        shm = Path(tempfile.mkdtemp(prefix="tierstate-agent-", dir=args.shm))
        try:  # which goes first alternates: the disk's state after one run (dirty pages, writeback) is the next's
            if round_ % 2:
                seconds, behind, copies = killed(root / "killed", shm / "killed", args.mib, args.steps, args.nice)
            normal, normal_behind = normal_flushes(root / "normal", shm / "normal", args.mib, args.steps)
            if not round_ % 2:
                seconds, behind, copies = killed(root / "killed", shm / "killed", args.mib, args.steps, args.nice)
        finally:
            shutil.rmtree(root, ignore_errors=True)
            shutil.rmtree(shm, ignore_errors=True)
        ratio = seconds / normal if normal else float("nan")
        rows.append((normal, seconds, ratio))
        print(f"round {round_ + 1}: the runner's own flushes: {normal_behind} of {args.steps} behind at the last "
              f"commit, all on NVMe {normal:.3f} s later; killed with {len(behind)} behind, the agent had them all "
              f"on NVMe {seconds:.3f} s after the kill = {ratio:.2f}x; its copies took "
              f"{', '.join(f'{c:.3f}' for c in copies)} s")  # fmt: skip
    ratios = [r for *_, r in rows if r == r]  # nan: every step was on NVMe at the kill already
    print(f"median: {statistics.median(ratios):.2f}x the normal flush time ({args.mib} MiB a checkpoint)")


if __name__ == "__main__":
    main()
