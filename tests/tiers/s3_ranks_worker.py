"""What each of two ranks runs for tests/tiers/test_s3_ranks.py: a bucket behind a job of two ranks.

Usage (two plain processes or two torchrun "nodes", rank and world from the environment, the S3
endpoint and credentials too): ``python tests/tiers/s3_ranks_worker.py WORKDIR ENDPOINT URL SCENARIO``.

- ``save``: a shared PFS tier flushed to the bucket; commits step 2 (rank 0 uploads it) and records
  the state. ``restore``: restores the latest step into a model of other weights and records where
  each rank read it and whether it matches.
- ``persist-shared`` / ``persist-node``: the bucket is the persist tier, staged in one shared
  directory or in each node's own (``{node}`` in the path); checkpoints steps 1 and 2 and records
  each handle's outcome. ``restore-shared`` / ``restore-node``: restores with the same config.
  ``again-shared``: a new run checkpoints step 2 again, which the bucket holds. ``killed-shared``:
  checkpoints step 1 with a tensor large enough for a multipart upload, during which the test
  SIGKILLs rank 1 (``TIERSTATE_FAULT=s3.part``); rank 0 records how its checkpoint ended.
- ``flush-node``: each node's own NVMe is the persist tier, flushed to the bucket (each node's leader
  uploads its part); checkpoints steps 1 to 3. ``restoreflushed-node``: restores with that config.

Each rank writes ``WORKDIR/<scenario>/rank-R.json`` and then prints ``S3-RANKS-DONE``.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from tierstate import Runner
from tierstate.providers import ModuleProvider, TensorDictProvider


def _runner(workdir: Path, endpoint: str, url: str) -> Runner:
    bucket = {"kind": "s3", "url": url, "endpoint_url": endpoint, "region": "us-east-1",
              "flush": {"every": 1}, "retention": {"keep_last": 2}}  # fmt: skip
    return Runner.from_dict({"chunk_size": "1MiB", "tiers": {"pfs": {"path": str(workdir / "pfs")}, "bucket": bucket}})


def _persist_runner(workdir: Path, endpoint: str, url: str, scope: str) -> Runner:
    staging = str(workdir / ("staging" if scope == "shared" else "nodes/{node}/staging"))
    bucket = {"kind": "s3", "url": url, "endpoint_url": endpoint, "region": "us-east-1", "staging": staging,
              "staging_scope": scope, "retention": {"keep_last": 2}}  # fmt: skip
    stages = {"capture": {"next": "serialize"}, "serialize": {"next": "persist"}, "persist": {"tier": "bucket"}}
    return Runner.from_dict({"chunk_size": "1MiB", "tiers": {"bucket": bucket}, "pipeline": {"stages": stages}})


def _flush_runner(workdir: Path, endpoint: str, url: str, scope: str) -> Runner:
    nvme = {"path": str(workdir / "nodes/{node}/nvme"), "scope": scope, "retention": {"keep_last": 1}}
    bucket = {"kind": "s3", "url": url, "endpoint_url": endpoint, "region": "us-east-1",
              "flush": {"every": 1}, "retention": {"keep_last": 2}}  # fmt: skip
    return Runner.from_dict({"chunk_size": "1MiB", "tiers": {"nvme": nvme, "bucket": bucket}})


MakeRunner = Callable[[Path, str, str, str], Runner]


def _model(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(256, 512), nn.Linear(512, 256))


def save(workdir: Path, endpoint: str, url: str) -> dict:
    model = _model(0)
    runner = _runner(workdir, endpoint, url)
    runner.register(model=ModuleProvider(model, replicated=True))
    runner.checkpoint(2).result()
    runner.close()  # waits for the upload
    torch.save(model.state_dict(), workdir / f"saved-{dist.get_rank()}.pt")
    return {"flush_errors": [str(f) for f in runner.flush_failures]}


def restore(workdir: Path, endpoint: str, url: str) -> dict:
    model = _model(1)
    runner = _runner(workdir, endpoint, url)
    runner.register(model=ModuleProvider(model, replicated=True))
    result = runner.restore("latest")
    runner.close()
    saved = torch.load(workdir / f"saved-{dist.get_rank()}.pt")
    same = all(torch.equal(saved[k], v) for k, v in model.state_dict().items())
    return {"step": result.step, "tier": result.tier, "tier_by_rank": list(result.tier_by_rank),
            "source": result.source, "problems": list(result.problems), "same": same}  # fmt: skip


def persist(
    workdir: Path, endpoint: str, url: str, scope: str, make: MakeRunner = _persist_runner,
    steps: tuple[int, ...] = (1, 2),
) -> dict:
    model = _model(0)
    runner = make(workdir, endpoint, url, scope)
    runner.register(model=ModuleProvider(model, replicated=False))
    outcomes = {}
    for step in steps:
        with torch.no_grad():
            model[0].weight.add_(1.0 + dist.get_rank())  # each rank's state its own
        result = runner.checkpoint(step).result()
        outcomes[step] = {"tier": result.tier, "path": str(result.path)}
    runner.close()  # waits for the flushes
    torch.save(model.state_dict(), workdir / f"saved-{dist.get_rank()}.pt")
    return {"outcomes": outcomes, "flush_errors": [str(f) for f in runner.flush_failures]}


def flush(workdir: Path, endpoint: str, url: str, scope: str) -> dict:
    return persist(workdir, endpoint, url, scope, make=_flush_runner, steps=(1, 2, 3))


def restore_persisted(workdir: Path, endpoint: str, url: str, scope: str, make: MakeRunner = _persist_runner) -> dict:
    model = _model(1)
    runner = make(workdir, endpoint, url, scope)
    runner.register(model=ModuleProvider(model, replicated=False))
    result = runner.restore("latest")
    runner.close()
    saved = torch.load(workdir / f"saved-{dist.get_rank()}.pt")
    same = all(torch.equal(saved[k], v) for k, v in model.state_dict().items())
    return {"step": result.step, "tier_by_rank": list(result.tier_by_rank), "same": same}


def restore_flushed(workdir: Path, endpoint: str, url: str, scope: str) -> dict:
    return restore_persisted(workdir, endpoint, url, scope, make=_flush_runner)


def again(workdir: Path, endpoint: str, url: str, scope: str) -> dict:
    runner = _persist_runner(workdir, endpoint, url, scope)
    runner.register(model=ModuleProvider(_model(2), replicated=False))
    handle = runner.checkpoint(2)
    handle.wait()
    runner.close()
    error = handle.exception()
    return {"error": None if error is None else f"{type(error).__name__}: {error}"}


def killed(workdir: Path, endpoint: str, url: str, scope: str) -> dict:
    runner = _persist_runner(workdir, endpoint, url, scope)
    runner.register(model=ModuleProvider(_model(0)), big=TensorDictProvider({"w": torch.randn(6 << 20)}))
    handle = runner.checkpoint(1)
    handle.wait()  # rank 1 dies uploading: rank 0 must not wait for it forever, nor publish without it
    error = handle.exception()
    runner.close()
    return {"error": None if error is None else f"{type(error).__name__}: {error}"}


def main() -> None:
    workdir, endpoint, url, scenario = Path(sys.argv[1]), sys.argv[2], sys.argv[3], sys.argv[4]
    dist.init_process_group("gloo")
    if scenario in ("save", "restore"):
        facts = {"save": save, "restore": restore}[scenario](workdir, endpoint, url)
    else:
        kind, scope = scenario.split("-")
        run = {"persist": persist, "restore": restore_persisted, "again": again, "killed": killed, "flush": flush,
               "restoreflushed": restore_flushed}[kind]  # fmt: skip
        facts = run(workdir, endpoint, url, scope)
    out = workdir / scenario
    out.mkdir(parents=True, exist_ok=True)
    (out / f"rank-{dist.get_rank()}.json").write_text(json.dumps(facts, indent=1))
    print("S3-RANKS-DONE", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
