"""A trainer whose checkpoints go to a memory tier first, for tests/pipeline/test_memory_tier.py.

Usage: ``python tests/memory_worker.py WORKDIR MEMORY_DIR MODE`` with MODE one of

* ``train``: eight steps, checkpoints after steps 2 and 4, every one flushed to NVMe; the losses of
  steps 5 to 8 are the reference;
* ``crash``: the same, but once step 2 is on NVMe it arms the fault hook that SIGKILLs this process
  at the first frame a flush copies (tiers/storage/faults.py): step 4 then commits in memory and the
  process dies copying it to NVMe, before the NVMe commit;
* ``resume``: a new process from other weights restores the latest step and trains to step 8.

The memory tier is MEMORY_DIR (a tmpfs directory such as /dev/shm/..., or any directory in tests),
NVMe is WORKDIR/nvme. What the process saw goes to WORKDIR/MODE.json.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch
from torch import nn
from toy_regression import model_and_optimizer, train_step

from tierstate.pipeline.runner import Runner
from tierstate.providers import ModuleProvider, ObjectProvider, OptimizerProvider, RNGProvider
from tierstate.tiers.storage.faults import ENV as FAULT_ENV

STEPS = 8
SAVED_AT = (2, 4)


def runner(workdir: Path, memory: Path) -> Runner:
    return Runner.from_dict({
        "chunk_size": "1MiB",
        "host_cache": {"size": "4MiB"},
        "tiers": {
            "memory": {"kind": "memory", "path": str(memory), "size": "16MiB", "retention": {"keep_last": 1}},
            "nvme": {"path": str(workdir / "nvme"), "flush": {"every": 1}},
        },
    })  # fmt: skip


def step(model: nn.Module, opt: torch.optim.Optimizer) -> float:
    return train_step(model, opt, torch.randn(16, 32))


def register(run: Runner, model: nn.Module, opt: torch.optim.Optimizer, counter: dict) -> None:
    run.register(model=model, optim=opt, rng=RNGProvider(), trainer=ObjectProvider(counter))
    assert isinstance(run.providers.children["model"], ModuleProvider)
    assert isinstance(run.providers.children["optim"], OptimizerProvider)


def train(workdir: Path, memory: Path, crash: bool) -> dict:
    model, opt = model_and_optimizer(seed=0, width=32)
    torch.manual_seed(1)
    counter = {"step": 0}
    run = runner(workdir, memory)
    register(run, model, opt, counter)
    losses = []
    for n in range(1, STEPS + 1):
        losses.append(step(model, opt))
        counter["step"] = n
        if n in SAVED_AT:
            handle = run.checkpoint(n)
            handle.result()  # committed in memory
            if crash and n == SAVED_AT[0]:
                handle.tier_futures["nvme"].result()  # step 2 is on NVMe too
                os.environ[FAULT_ENV] = "migrate.frame@1"  # SIGKILL in the next flush: step 4's, to NVMe
    run.close()
    return {"losses": losses[SAVED_AT[-1] :]}


def resume(workdir: Path, memory: Path) -> dict:
    model, opt = model_and_optimizer(seed=123, width=32)
    torch.manual_seed(7)  # overwritten by the restored RNG state
    counter = {"step": -1}
    run = runner(workdir, memory)
    register(run, model, opt, counter)
    result = run.restore("latest")
    losses = [step(model, opt) for _ in range(counter["step"], STEPS)]
    run.close()
    return {"step": counter["step"], "tier": result.tier, "tier_by_rank": list(result.tier_by_rank), "losses": losses}


def main() -> None:
    workdir, memory, mode = Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3]
    facts = resume(workdir, memory) if mode == "resume" else train(workdir, memory, crash=mode == "crash")
    (workdir / f"{mode}.json").write_text(json.dumps(facts))
    print(f"MEMORY-DONE {mode}", flush=True)


if __name__ == "__main__":
    main()
