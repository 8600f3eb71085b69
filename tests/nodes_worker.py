"""What each rank runs for tests/pipeline/test_nodes.py: one rank per simulated node, NVMe per node.

Usage (one launch per node, ``TIERSTATE_NODE`` naming it): ``torchrun --nnodes=2 --nproc_per_node=1
--node_rank=I --master_addr=127.0.0.1 --master_port=P tests/nodes_worker.py WORKDIR SCENARIO...``.
The NVMe tier is ``WORKDIR/nodes/{node}/nvme`` (scope: node): no rank looks into another node's.
The PFS tier ``WORKDIR/pfs`` is shared and receives every checkpoint. The ``train`` and ``resume``
scenarios write to a memory tier first (``WORKDIR/nodes/{node}/memory``, kind: memory, keep_last: 1),
which flushes to both; ``train-last`` persists to NVMe. ``train-peers`` / ``resume-peers`` persist to
NVMe with ``replicas: 1``: each node's part also goes to the other node's NVMe (a peer copy);
``train-peers-pruned`` keeps one step on NVMe and holds the peer copies back until step 4 replaced step 2;
``damage-peer-copy`` empties n1's NVMe and flips a byte of n1's part in n0's copy;
``train-peers-killed`` commits steps 2 and 4 with their peer copies held back, records, and SIGKILLs
itself (a crash before the copies' turn); ``train-memory-peers-killed`` does so with the memory tier
first and its flushes hung, so NVMe never got those steps; ``resume-peers-save`` and
``resume-memory-peers-save`` restore and commit step 6 too. What a rank saw goes to
``WORKDIR/<scenario>/rank-R.json``; ``NODES-DONE <scenario>`` on stdout says it is recorded.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import shutil
import signal
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from toy_regression import model_and_optimizer, train_step

from tierstate.pipeline.runner import Runner
from tierstate.providers import ModuleProvider, ObjectProvider, OptimizerProvider, RNGProvider
from tierstate.tiers.storage import faults
from tierstate.tiers.storage.filesystem import FilesystemTier
from tierstate.tiers.storage.peers import kept_for

REPO = Path(__file__).resolve().parent.parent
CONFIG = REPO / "configs" / "default.yaml"
STEPS = 8
SAVED_AT = (2, 4)
GROUP_TIMEOUT_S = 20  # also how long a node waits for the others' parts on the PFS


def _runner(workdir: Path, memory: bool = True, replicas: int = 0, keep_last: int | None = None) -> Runner:
    node = workdir / "nodes" / "{node}"
    tiers = {
        "nvme": {
            "path": str(node / "nvme"),
            "scope": "node",
            "replicas": replicas,
            "retention": {"keep_last": keep_last},
        },  # fmt: skip
        "pfs": {"path": str(workdir / "pfs"), "flush": {"every": 1}},
    }
    if memory:
        bound = {"size": "64MiB", "retention": {"keep_last": 1}}
        tiers = {"memory": {"kind": "memory", "path": str(node / "memory"), **bound}, **tiers}
        tiers["nvme"]["flush"] = {"every": 1}
    settings = {"tiers": tiers, "pipeline.stages.persist.tier": next(iter(tiers))}
    return Runner.from_yaml(CONFIG, settings, group_timeout=GROUP_TIMEOUT_S)


def _ddp(seed: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    return model_and_optimizer(seed, width=16, ddp=True)


def _step(model: nn.Module, opt: torch.optim.Optimizer) -> float:
    return train_step(model, opt, torch.randn(8, 16))  # each rank its own data, from its own RNG stream


def _register(runner: Runner, model: nn.Module, opt: torch.optim.Optimizer, counter: dict) -> None:
    runner.register(
        model=ModuleProvider(model, replicated=True),
        optim=OptimizerProvider(opt, replicated=True),
        rng=RNGProvider(),
        trainer=ObjectProvider(counter, replicated=True),
    )


def train(
    workdir: Path, rank: int, saved_at: tuple[int, ...] = SAVED_AT, memory: bool = True, replicas: int = 0
) -> dict[str, Any]:
    """Eight DDP steps, checkpoints after steps 2 and 4; the losses after step 4 are the reference."""
    model, opt = _ddp(seed=0)
    torch.manual_seed(100 + rank)
    counter = {"step": 0}
    runner = _runner(workdir, memory, replicas)
    _register(runner, model, opt, counter)
    handles, losses = [], []
    for step in range(1, STEPS + 1):
        losses.append(_step(model, opt))
        counter["step"] = step
        if step in saved_at:
            handles.append(runner.checkpoint(step))
    runner.close()  # waits for the flushes too
    return {
        "losses": losses[saved_at[-1] :],
        "paths": [str(h.result().path) if h.exception() is None else f"failed: {h.exception()}" for h in handles],
        "persisted": [h.persisted("pfs") for h in handles],
        "on_nvme": [h.persisted("nvme") for h in handles],
        "flush_errors": [str(f) for f in runner.flush_failures],
    }


def resume(workdir: Path, rank: int, memory: bool = True, replicas: int = 0) -> dict[str, Any]:
    """A new job from other weights: restore the latest step, run to the end; the same losses expected."""
    model, opt = _ddp(seed=123)
    torch.manual_seed(7)
    counter = {"step": -1}
    runner = _runner(workdir, memory, replicas)
    _register(runner, model, opt, counter)
    result = runner.restore("latest")
    losses = [_step(model, opt) for _ in range(counter["step"], STEPS)]
    runner.close()
    return {"step": counter["step"], "tier": result.tier, "tier_by_rank": list(result.tier_by_rank), "losses": losses}


def train_pruned(workdir: Path, rank: int) -> dict[str, Any]:
    """``train-peers`` keeping one step on NVMe, step 2's peer copy held back (the peer thread kept busy)
    until step 4 has replaced step 2 there: step 2 is not sent, and that is no failure."""
    model, opt = _ddp(seed=0)
    counter = {"step": 0}
    runner = _runner(workdir, memory=False, replicas=1, keep_last=1)
    _register(runner, model, opt, counter)
    assert runner._peers is not None
    release = threading.Event()
    runner._peers._thread.submit(release.wait)  # the transfers queue behind this
    for step in range(1, 5):
        _step(model, opt)
        counter["step"] = step
        if step in SAVED_AT:
            runner.checkpoint(step).result()
    runner._flusher.drain()  # both steps on the PFS, and retention has pruned step 2 from NVMe
    on_nvme = FilesystemTier("nvme", workdir / "nodes" / f"n{rank}" / "nvme", "node").steps()
    release.set()
    runner.close()  # the held transfers run
    return {"on_nvme_when_sent": on_nvme, "flush_errors": [str(f) for f in runner.flush_failures]}


def train_killed(workdir: Path, rank: int, memory: bool = False) -> dict[str, Any]:
    """``train-peers`` whose peer copies never get their turn: the process is SIGKILLed once steps 2 and 4
    are committed, with their transfers still queued. Without ``memory`` they are on NVMe and the PFS;
    with it they are in the memory tier only, their flushes hung at their first frame."""
    model, opt = _ddp(seed=0)
    counter = {"step": 0}
    runner = _runner(workdir, memory=memory, replicas=1)
    _register(runner, model, opt, counter)
    assert runner._peers is not None
    hung = threading.Event()
    runner._peers._thread.submit(hung.wait)  # the transfers queue behind this, for good
    hang = faults.inject("migrate.frame", lambda _: hung.wait()) if memory else contextlib.nullcontext()
    with hang:  # with the memory tier no flush goes past its first frame
        for step in range(1, 5):
            _step(model, opt)
            counter["step"] = step
            if step in SAVED_AT:
                runner.checkpoint(step).result()
        if not memory:
            runner._flusher.drain()
        dist.barrier()  # neither rank dies while the other still needs it
        _record(workdir, "train-memory-peers-killed" if memory else "train-peers-killed", rank, {})
        os.kill(os.getpid(), signal.SIGKILL)
    raise AssertionError("unreachable: SIGKILL")


def resume_and_save(workdir: Path, rank: int, memory: bool = False) -> dict[str, Any]:
    """Restore the latest step with peer copies on, train to the end and commit step 6 on the way. With
    ``memory``, the flushes the killed run left (memory -> NVMe) are held until step 6 has committed."""
    model, opt = _ddp(seed=123)
    counter = {"step": -1}
    committed = threading.Event()
    held = faults.inject("migrate.frame", lambda _: committed.wait()) if memory else contextlib.nullcontext()
    with held:
        runner = _runner(workdir, memory=memory, replicas=1)
        _register(runner, model, opt, counter)
        restored = runner.restore("latest")
        for step in range(counter["step"] + 1, STEPS + 1):
            _step(model, opt)
            counter["step"] = step
            if step == 6:
                runner.checkpoint(step).result()
                committed.set()
        runner.close()
    return {"restored": [restored.step, restored.tier], "flush_errors": [str(f) for f in runner.flush_failures]}


def damage(workdir: Path, rank: int) -> dict[str, Any]:
    """n1 is replaced (its NVMe empty), and the copy of n1's part that n0 keeps has a flipped byte."""
    nvme = FilesystemTier("nvme", workdir / "nodes" / f"n{rank}" / "nvme", "node")
    if rank == 0:
        kept = kept_for(nvme, "n1")
        data = kept.step_dir(4) / "rank-00001.data"
        frame = kept.manifest(4).files["rank-00001.data"].frames[0]
        raw = bytearray(data.read_bytes())
        raw[frame.offset + frame.length // 2] ^= 0xFF  # inside a frame: the padding between frames is no data
        data.write_bytes(bytes(raw))
    else:
        shutil.rmtree(nvme.root)
    dist.barrier()
    return {}


SCENARIOS: dict[str, Callable[[Path, int], dict[str, Any]]] = {
    "train": train,
    "resume": resume,
    "resume-again": resume,  # after more copies were wiped
    # One checkpoint after the last step, on NVMe: a node that dies flushing it takes no training down with it.
    "train-last": functools.partial(train, saved_at=(STEPS,), memory=False),
    "train-peers": functools.partial(train, memory=False, replicas=1),
    "resume-peers": functools.partial(resume, memory=False, replicas=1),
    "damage-peer-copy": damage,
    "train-peers-pruned": train_pruned,
    "train-peers-killed": train_killed,
    "resume-peers-save": resume_and_save,
    "train-memory-peers-killed": functools.partial(train_killed, memory=True),
    "resume-memory-peers-save": functools.partial(resume_and_save, memory=True),
}


def _record(workdir: Path, scenario: str, rank: int, facts: dict[str, Any]) -> None:
    out = workdir / scenario
    out.mkdir(parents=True, exist_ok=True)
    (out / f"rank-{rank}.json").write_text(json.dumps(facts, indent=1))
    print(f"NODES-DONE {scenario}", flush=True)


def main() -> None:
    workdir, names = Path(sys.argv[1]), sys.argv[2:]
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    for name in names:
        _record(workdir, name, rank, SCENARIOS[name](workdir, rank))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
