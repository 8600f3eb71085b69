"""What each rank runs under ``torchrun`` for tests/pipeline/test_distributed.py (gloo, CPU).

Usage: ``torchrun --standalone --nproc_per_node=N tests/dist_worker.py WORKDIR SCENARIO...``.
Scenarios run in order in the same processes; each reads and writes only under WORKDIR and
records what it saw in ``WORKDIR/<scenario>/rank-R.json`` for the test to check. State is
rebuilt from fixed seeds, so a scenario that restores can recompute exactly what was saved.
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor
from toy_regression import model_and_optimizer, train_step

from launch import mark_finished
from tierstate import NothingToRestoreError, TierstateError
from tierstate.pipeline.agent import AgentFiles, agent_pid
from tierstate.pipeline.distributed import EXIT_BEFORE_VOTE_ENV
from tierstate.pipeline.runner import Runner
from tierstate.providers import (
    ModuleProvider,
    ObjectProvider,
    OptimizerProvider,
    RNGProvider,
    ShardInfo,
    TensorDictProvider,
)
from tierstate.providers.items import TensorItem
from tierstate.tiers.format.format import read_manifest
from tierstate.tiers.ops.migrate import migrate
from tierstate.tiers.storage.filesystem import FilesystemTier

REPO = Path(__file__).resolve().parent.parent


CONFIG = REPO / "configs" / "default.yaml"
SHARDED_SHAPE = (7, 33)  # rows split unevenly across ranks
DTENSOR_SHAPE = (6, 10)


def rows(rank: int, world: int, total: int) -> tuple[int, int]:
    """This rank's rows of a row-split tensor: the first ranks take one more when it does not divide."""
    base, extra = divmod(total, world)
    start = rank * base + min(rank, extra)
    return start, start + base + (1 if rank < extra else 0)


def global_values() -> dict[str, torch.Tensor]:
    """The whole tensors every layout is cut from (same on every rank and every run)."""
    gen = torch.Generator().manual_seed(7)
    return {
        "shards/w": torch.randn(SHARDED_SHAPE, generator=gen, dtype=torch.float64),
        "dt/weight": torch.randn(DTENSOR_SHAPE, generator=gen).to(torch.bfloat16),
    }


def make_model(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(64, 96), nn.ReLU(), nn.Linear(96, 128), nn.Linear(128, 48), nn.Linear(48, 8))


class RowShard:
    """A user provider holding this rank's rows of ``shards/w``, described with a ShardInfo."""

    def __init__(self, rank: int, world: int, values: torch.Tensor) -> None:
        self.start, _ = rows(rank, world, SHARDED_SHAPE[0])
        self.tensor = values

    def describe(self) -> list[TensorItem]:
        return [TensorItem("w", self.tensor, shard=ShardInfo(SHARDED_SHAPE, (self.start, 0)))]

    def restore(self, state: Mapping[str, Any]) -> None:
        self.tensor.copy_(state["w"])


class DTensorHolder(nn.Module):
    def __init__(self, value: torch.Tensor) -> None:
        super().__init__()
        self.weight = nn.Parameter(value, requires_grad=False)


def sharded_providers(rank: int, world: int, scrambled: bool) -> tuple[dict[str, Any], Callable[[], dict]]:
    """Providers for the sharded state (row shards and a DTensor), and a check of their values."""
    full = global_values()
    start, end = rows(rank, world, SHARDED_SHAPE[0])
    local = full["shards/w"][start:end].clone()
    mesh = init_device_mesh("cpu", (world,))
    holder = DTensorHolder(distribute_tensor(full["dt/weight"], mesh, [Shard(0)]))
    want_dt = holder.weight.to_local().clone()
    if scrambled:
        local.fill_(-1.0)
        holder.weight.to_local().fill_(0)

    def check() -> dict[str, bool]:
        return {
            "shards/w": torch.equal(local, full["shards/w"][start:end]),
            "dt/weight": torch.equal(holder.weight.to_local(), want_dt),
        }

    return {"shards": RowShard(rank, world, local), "dt": ModuleProvider(holder)}, check


def replicated_providers(scrambled: bool) -> tuple[dict[str, Any], Callable[[], dict]]:
    model = make_model(seed=99 if scrambled else 0)
    expected = make_model(seed=0).state_dict()

    def check() -> dict[str, bool]:
        return {f"model/{k}": torch.equal(v, expected[k]) for k, v in model.state_dict().items()}

    shared = {"name": "run-a", "lr": 0.5}
    return {"model": ModuleProvider(model, replicated=True), "run": ObjectProvider(shared, replicated=True)}, check


GROUP_TIMEOUT_S = 60


def runner_at(nvme: Path, pfs: Path) -> Runner:
    settings = {"tiers": {"nvme": {"path": str(nvme)}, "pfs": {"path": str(pfs)}}}
    return Runner.from_yaml(CONFIG, settings, group_timeout=GROUP_TIMEOUT_S)


class Scenario:
    def __init__(self, workdir: Path, name: str) -> None:
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.workdir = workdir
        self.out = workdir / name
        self.out.mkdir(parents=True, exist_ok=True)

    def runner(self, tiers: str) -> Runner:
        """A runner whose tiers are ``WORKDIR/tiers/<tiers>/{nvme,pfs}``, shared by all ranks."""
        base = self.workdir / "tiers" / tiers
        return runner_at(base / "nvme", base / "pfs")

    def record(self, **facts: Any) -> None:
        (self.out / f"rank-{self.rank}.json").write_text(json.dumps(facts, indent=1))


def save(s: Scenario) -> None:
    """Replicated model and object, row shards, a DTensor, per-rank RNG and object: one checkpoint."""
    runner = s.runner("save")
    replicated, _ = replicated_providers(scrambled=False)
    sharded, _ = sharded_providers(s.rank, s.world, scrambled=False)
    torch.manual_seed(100 + s.rank)  # after the model's seeding: each rank its own generator state
    runner.register(**replicated, **sharded, rng=RNGProvider(), mine=ObjectProvider({"rank": s.rank}))
    result = runner.checkpoint(1).result(timeout=60)
    after = torch.rand(4).tolist()  # what the restored RNG must draw next
    runner.close()
    s.record(path=str(result.path), raw_bytes=result.raw_bytes, after=after)


def restore(s: Scenario) -> None:
    """Restore ``save``'s checkpoint into scrambled state; every value must come back bit-exact."""
    saved = json.loads((s.out.parent / "save" / f"rank-{s.rank}.json").read_text())
    torch.manual_seed(5)
    runner = s.runner("save")
    replicated, check_replicated = replicated_providers(scrambled=True)
    sharded, check_sharded = sharded_providers(s.rank, s.world, scrambled=True)
    mine = ObjectProvider({"rank": -1})
    runner.register(**replicated, **sharded, rng=RNGProvider(), mine=mine)
    result = runner.restore("latest")
    same = {**check_replicated(), **check_sharded(), "rng": torch.rand(4).tolist() == saved["after"]}
    same["mine/value"] = mine.value == {"rank": s.rank}
    same["run/value"] = replicated["run"].value == {"name": "run-a", "lr": 0.5}
    runner.close()
    s.record(step=result.step, same=same, bytes_read=result.bytes_read)


def reshard(s: Scenario) -> None:
    """Restore the one-process checkpoint the test wrote (whole tensors) into this world's shards."""
    runner = s.runner("single")
    replicated, check_replicated = replicated_providers(scrambled=True)
    sharded, check_sharded = sharded_providers(s.rank, s.world, scrambled=True)
    runner.register(model=replicated["model"], **sharded)
    result = runner.restore("latest")
    runner.close()
    s.record(step=result.step, same={**check_replicated(), **check_sharded()})


def _failure(runner: Runner, step: int) -> str:
    """Request ``step`` and wait for it; what its handle says went wrong."""
    handle = runner.checkpoint(step)
    handle.wait(60)
    return f"{type(handle.error).__name__}: {handle.error}"


def failures(s: Scenario) -> None:
    """Steps 1 and 4 commit. Rank 1 alone fails at step 2 (writing), at step 3 (describing its
    state) and at step 5 (its reused plan no longer fits a tensor, found in the background before the
    opening), and at step 6 leaves the process after writing its files, before voting."""
    runner = s.runner("failures")
    replicated, _ = replicated_providers(scrambled=False)
    torch.manual_seed(100 + s.rank)
    extra: dict[str, Any] = {"rank": s.rank}

    def mine() -> dict[str, Any]:
        if extra.get("explode"):
            raise RuntimeError("sampler state unavailable")
        return extra

    pair = {"a": torch.zeros(4), "b": torch.ones(4)}  # one stack copies both at each request (plan_cache.py)
    runner.register(**replicated, rng=RNGProvider(), mine=ObjectProvider(mine), pair=TensorDictProvider(pair))
    facts: dict[str, Any] = {"first": str(runner.checkpoint(1).result(timeout=60).path)}
    if s.rank == 1:
        extra["bad"] = {1, 2}  # a set is not msgpack data: this rank's part of step 2 fails
    facts["refused"] = _failure(runner, 2)
    extra.pop("bad", None)
    extra["explode"] = s.rank == 1
    facts["declined"] = _failure(runner, 3)
    extra.pop("explode")
    facts["fourth"] = str(runner.checkpoint(4).result(timeout=60).path)
    if s.rank == 1:
        pair["b"].data = pair["b"].data.half()  # narrowed in place: the stack widens it back, unseen until the check
    facts["replanned"] = _failure(runner, 5)
    pair["b"].data = pair["b"].data.float()
    s.record(**facts)  # rank 1 records nothing after this
    os.environ[EXIT_BEFORE_VOTE_ENV] = "1:6"
    facts["died"] = _failure(runner, 6)  # rank 1 leaves the process inside this step's commit
    model = make_model(seed=1)
    for _ in range(3):  # training goes on without the checkpoint group
        model(torch.randn(2, 64)).sum().backward()
    facts["after"] = _failure(runner, 7)
    runner.close()
    s.record(**facts)


def failures_restore(s: Scenario) -> None:
    """A new job after the crash: the latest committed step is 4, and it restores."""
    runner = s.runner("failures")
    replicated, check = replicated_providers(scrambled=True)
    runner.register(**replicated)
    result = runner.restore("latest")
    runner.close()
    s.record(step=result.step, same=check())


def _ddp(seed: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    return model_and_optimizer(seed, width=16, ddp=True)


def _ddp_step(model: nn.Module, opt: torch.optim.Optimizer) -> float:
    return train_step(model, opt, torch.randn(8, 16))


def _ddp_runner(s: Scenario, model: nn.Module, opt: torch.optim.Optimizer, counter: dict) -> Runner:
    runner = s.runner("ddp")
    runner.register(
        model=ModuleProvider(model, replicated=True),
        optim=OptimizerProvider(opt, replicated=True),
        rng=RNGProvider(),
        trainer=ObjectProvider(counter, replicated=True),
    )
    runner.attach(opt)
    return runner


def ddp(s: Scenario) -> None:
    """Eight DDP steps with a checkpoint after the fourth; the losses after it are the reference."""
    model, opt = _ddp(seed=0)
    torch.manual_seed(100 + s.rank)  # each rank its own data
    counter = {"step": 0}
    runner = _ddp_runner(s, model, opt, counter)
    losses = []
    for step in range(1, 9):
        losses.append(_ddp_step(model, opt))
        counter["step"] = step
        if step == 4:
            runner.checkpoint(4)
    runner.close()
    s.record(losses=losses[4:])


def ddp_resume(s: Scenario) -> None:
    """A new job from other initial weights: restore step 4, run steps 5..8, same losses expected."""
    model, opt = _ddp(seed=123)
    torch.manual_seed(7)
    counter = {"step": -1}
    runner = _ddp_runner(s, model, opt, counter)
    runner.restore("latest")
    losses = [_ddp_step(model, opt) for _ in range(counter["step"], 8)]
    runner.close()
    s.record(step=counter["step"], losses=losses)


def cadence(s: Scenario) -> None:
    """Sixteen DDP steps with ``maybe_checkpoint`` (``every: auto``) after each, rank 1's steps after a checkpoint
    slower (its cost measures higher): the ranks still take the same steps, each one committed."""
    model, opt = _ddp(seed=0)
    base = s.workdir / "tiers" / "cadence"
    settings = {"tiers": {"nvme": {"path": str(base / "nvme")}, "pfs": {"path": str(base / "pfs")}},
                "cadence": {"every": "auto", "warmup": 2}}  # fmt: skip
    runner = Runner.from_yaml(CONFIG, settings, group_timeout=GROUP_TIMEOUT_S)
    runner.register(model=ModuleProvider(model, replicated=True), optim=OptimizerProvider(opt, replicated=True))
    taken, handles = [], []
    for step in range(1, 17):
        _ddp_step(model, opt)
        if s.rank == 1 and taken and taken[-1] == step - 1:
            time.sleep(0.2)  # rank 1's trainer loses more to each checkpoint (simulated work, not a wait)
        handle = runner.maybe_checkpoint(step)
        if handle is not None:
            taken.append(step)
            handles.append(handle)
    outcomes = [h.wait(GROUP_TIMEOUT_S) and h.exception() is None for h in handles]
    runner.close()
    s.record(taken=taken, committed=outcomes)


def agent(s: Scenario) -> None:
    """Both ranks of this node checkpoint six DDP steps into the memory tier with the node agent on, NVMe every
    second step: one agent (started by one runner, found by the other) flushes both ranks' parts."""
    base = s.workdir / "tiers" / "agent"
    layout = {
        "chunk_size": "1MiB", "host_cache": {"size": "4MiB"}, "agent": {"enabled": True, "linger": 0.5},
        "tiers": {"memory": {"kind": "memory", "path": str(base / "memory"), "size": "64MiB",
                             "retention": {"keep_last": 1}},
                  "nvme": {"path": str(base / "nvme"), "flush": {"every": 2}, "retention": {"keep_last": 8}}},
    }  # fmt: skip
    model, opt = _ddp(seed=0)
    mine = {"w": torch.full((1 << 16,), float(s.rank))}
    runner = Runner.from_dict(layout, group_timeout=GROUP_TIMEOUT_S)
    runner.register(model=ModuleProvider(model, replicated=True), optim=OptimizerProvider(opt, replicated=True),
                    mine=TensorDictProvider(mine))  # fmt: skip
    flushed = []
    for step in range(1, 7):
        _ddp_step(model, opt)
        mine["w"].add_(10.0)
        handle = runner.checkpoint(step)
        if "nvme" in handle.tier_futures:
            flushed.append(str(handle.tier_futures["nvme"].result(timeout=GROUP_TIMEOUT_S)))
    files = AgentFiles.of(runner.config)
    seen = {"agent": agent_pid(files), "attached": sorted(int(n) for n in os.listdir(files.trainers))}
    dist.barrier()  # both ranks looked while both were attached
    runner.close()
    s.record(pid=os.getpid(), flushed=flushed, failures=[str(f) for f in runner.flush_failures],
             model={k: v.flatten().tolist() for k, v in model.state_dict().items()}, **seen)  # fmt: skip


# --- ranks whose tiers hold different steps agree on one, or all fail alike -------------------------------------

AGREE_STEPS = (1, 2, 3)


def _agree_state(step: int | None, rank: int) -> tuple[nn.Module, dict, dict[str, torch.Tensor]]:
    """The model, counter and per-rank tensor as they are at ``step`` (None: a new job's scrambled start)."""
    model = make_model(seed=99 if step is None else step)
    counter = {"step": -1 if step is None else step}
    mine = {"w": torch.full((3,), -1.0 if step is None else 100.0 * rank + step)}
    return model, counter, mine


def _agree_providers(
    model: nn.Module, counter: dict, mine: dict[str, torch.Tensor], load: Callable[[Any], None] | None = None
) -> dict[str, Any]:
    return {
        "model": ModuleProvider(model, replicated=True),
        "trainer": ObjectProvider(counter, load=load, replicated=True),
        "mine": TensorDictProvider(mine),
    }


def agree_save(s: Scenario) -> None:
    """Steps 1-3 on shared tiers; then rank 0 lays out the copies the ``agree`` cases give each rank."""
    base = s.workdir / "tiers" / "agree"
    runner = runner_at(base / "all" / "nvme", base / "all" / "pfs")
    model, counter, mine = _agree_state(None, s.rank)
    runner.register(**_agree_providers(model, counter, mine))
    for step in AGREE_STEPS:
        new_model, new_counter, new_mine = _agree_state(step, s.rank)
        model.load_state_dict(new_model.state_dict())
        counter.update(new_counter)
        mine["w"].copy_(new_mine["w"])
        runner.checkpoint(step).result(timeout=60)
    runner.close()
    if s.rank == 0:
        source = FilesystemTier("nvme", base / "all" / "nvme")
        for name, steps in {"old/nvme": (1, 2), "newest/pfs": (3,), "only3/nvme": (3,), "corrupt/nvme": (1, 2)}.items():
            for step in steps:
                migrate(step, source, FilesystemTier(name.split("/")[1], base / name))
        damaged = base / "corrupt" / "nvme" / "step-2"
        for frame in read_manifest(damaged).files["rank-00001.data"].frames:  # rank 1's part of step 2
            with open(damaged / "rank-00001.data", "r+b") as handle:
                handle.seek(frame.offset + frame.length // 2)
                byte = handle.read(1)[0]
                handle.seek(frame.offset + frame.length // 2)
                handle.write(bytes([byte ^ 0x08]))
    s.record(saved=list(AGREE_STEPS))


def readme_guard(runner: Runner) -> None:
    """The README's restore guard for many ranks ("Many ranks (torchrun)"), copied verbatim."""
    try:
        runner.restore("latest")  # every rank restores the same step, or every rank raises
    except NothingToRestoreError:
        pass  # no rank has any checkpoint yet: every rank starts fresh


# Each case: the tiers (nvme, pfs) of rank 0 and of rank 1 under WORKDIR/tiers/agree (None: an empty
# directory of that rank's own), how to restore, the rank whose model has a layer of another shape, and
# the rank whose trainer counters refuse any value but the scrambled start.
AGREE_CASES: dict[str, dict[str, Any]] = {
    "newest-on-a-slower-tier": {"tiers": (("all/nvme", None), ("old/nvme", "newest/pfs"))},
    "older-common-step": {"tiers": (("all/nvme", None), ("old/nvme", None))},
    "no-common-step": {"tiers": (("only3/nvme", None), ("old/nvme", None))},
    "unreadable-copy": {"tiers": (("all/nvme", None), ("corrupt/nvme", None))},
    "unreadable-copy-fallback": {"tiers": (("all/nvme", None), ("corrupt/nvme", None)), "fallback": True},
    "check-fails-on-rank-1": {"tiers": (("all/nvme", None), ("all/nvme", None)), "other_shape": 1},
    "restore-fails-on-rank-1": {"tiers": (("all/nvme", None), ("all/nvme", None)), "refuse_on": 1},
    "guard-no-checkpoint-anywhere": {"tiers": ((None, None), (None, None)), "guard": True},
    "guard-one-rank-has-none": {"tiers": (("all/nvme", None), (None, None)), "guard": True},
}


def _refuse(value: dict) -> None:
    if value != {"step": -1}:
        raise RuntimeError(f"counters {value} refused")


def agree(s: Scenario) -> None:
    """Every case on both ranks: which step each restored from which tier, or what each raised, and how fast."""
    base = s.workdir / "tiers" / "agree"
    seen: dict[str, dict[str, Any]] = {}
    for name, case in AGREE_CASES.items():
        nvme, pfs = (base / (p or f"empty/{name}/rank-{s.rank}/{i}") for i, p in enumerate(case["tiers"][s.rank]))
        runner = runner_at(nvme, pfs)
        model, counter, mine = _agree_state(None, s.rank)
        if case.get("other_shape") == s.rank:
            model[-1] = nn.Linear(48, 9)
        runner.register(**_agree_providers(model, counter, mine, _refuse if case.get("refuse_on") == s.rank else None))
        before = {**{k: v.clone() for k, v in model.state_dict().items()}, "mine": mine["w"].clone()}
        facts: dict[str, Any] = {}
        started = time.perf_counter()
        try:
            if case.get("guard"):
                readme_guard(runner)
                facts["guard"] = "went on"
            else:
                result = runner.restore("latest", fallback=case.get("fallback", False))
                facts |= {"step": result.step, "tier": result.tier, "problems": list(result.problems)}
                expected_model, expected_counter, expected_mine = _agree_state(result.step, s.rank)
                want = expected_model.state_dict()
                facts["same"] = all(torch.equal(v, want[k]) for k, v in model.state_dict().items()) and (
                    counter == expected_counter and torch.equal(mine["w"], expected_mine["w"])
                )
        except TierstateError as exc:
            facts["error"] = f"{type(exc).__name__}: {exc}"
        facts["seconds"] = time.perf_counter() - started
        now = {**model.state_dict(), "mine": mine["w"]}
        facts["unchanged"] = all(torch.equal(now[k], v) for k, v in before.items()) and counter == {"step": -1}
        runner.close()
        seen[name] = facts
    s.record(**seen)


def rng_more_ranks(s: Scenario) -> None:
    """Restore the one-process checkpoint of RNGs the test wrote (``tiers/rng1``) on two ranks: rank 0
    gets the saved streams; rank 1, which the checkpoint holds nothing of, derives its own from rank 0's
    (or, asked to, keeps its own, or refuses); what each draws next, and what the restore said."""
    seen: dict[str, Any] = {}
    for case in ("derive", "keep", "error"):
        torch.manual_seed(1000 + s.rank)  # this rank's own stream before the restore
        runner = s.runner("rng1")
        values = {"w": torch.zeros(4)}
        runner.register(rng=RNGProvider(missing_rank=case), t=TensorDictProvider(values))
        try:
            result = runner.restore("latest")
            seen[case] = {"kept": list(result.kept), "derived": list(result.derived), "w": values["w"].tolist(),
                          "draws": torch.rand(4).tolist()}  # fmt: skip
        except TierstateError as exc:
            seen[case] = {"error": f"{type(exc).__name__}: {exc}", "w": values["w"].tolist()}
        runner.close()
    s.record(**seen)


SCENARIOS: dict[str, Callable[[Scenario], None]] = {
    "rng-more-ranks": rng_more_ranks,
    "save": save,
    "restore": restore,
    "reshard": reshard,
    "failures": failures,
    "failures-restore": failures_restore,
    "ddp": ddp,
    "ddp-resume": ddp_resume,
    "agree-save": agree_save,
    "agree": agree,
    "cadence": cadence,
    "agent": agent,
}


def main() -> None:
    workdir, names = Path(sys.argv[1]), sys.argv[2:]
    dist.init_process_group("gloo")
    for i, name in enumerate(names):
        SCENARIOS[name](Scenario(workdir, name))
        if i + 1 < len(names):
            dist.barrier()
    mark_finished(workdir, dist.get_rank())
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
