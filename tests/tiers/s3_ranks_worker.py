"""What each of two ranks runs for tests/tiers/test_s3_ranks.py: a shared PFS tier flushed to a bucket.

Usage (two plain processes, rank and world from the environment, the S3 endpoint and credentials
too): ``python tests/tiers/s3_ranks_worker.py WORKDIR ENDPOINT URL SCENARIO``. ``save`` commits step 2
(rank 0 uploads it to the bucket) and records the state; ``restore`` restores the latest step into a
model of other weights and records where each rank read it and whether it matches. Each rank writes
``WORKDIR/<scenario>/rank-R.json`` and then prints ``S3-RANKS-DONE``.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from tierstate import Runner
from tierstate.providers import ModuleProvider


def _runner(workdir: Path, endpoint: str, url: str) -> Runner:
    bucket = {"kind": "s3", "url": url, "endpoint_url": endpoint, "region": "us-east-1",
              "flush": {"every": 1}, "retention": {"keep_last": 2}}  # fmt: skip
    return Runner.from_dict({"chunk_size": "1MiB", "tiers": {"pfs": {"path": str(workdir / "pfs")}, "bucket": bucket}})


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


def main() -> None:
    workdir, endpoint, url, scenario = Path(sys.argv[1]), sys.argv[2], sys.argv[3], sys.argv[4]
    dist.init_process_group("gloo")
    facts = {"save": save, "restore": restore}[scenario](workdir, endpoint, url)
    out = workdir / scenario
    out.mkdir(parents=True, exist_ok=True)
    (out / f"rank-{dist.get_rank()}.json").write_text(json.dumps(facts, indent=1))
    print("S3-RANKS-DONE", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
