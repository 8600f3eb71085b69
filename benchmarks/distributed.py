"""Benchmark: time to durable on 1 rank vs 2 ranks for the same total state (torchrun, gloo, CPU).

Three ways to hold ``--total`` bytes of float32 weights:

- ``1 rank``: one process holds and writes all of it;
- ``2 ranks, sharded``: each rank holds half (row shards of the same global tensors) and writes it;
- ``2 ranks, replicated``: each rank holds all of it (data parallel), marked replicated, so it is
  written once, half by each rank.

"Durable" is the wall time from ``checkpoint(step)`` on every rank (started together after a
barrier) to the global commit being announced to all of them (the slowest rank), so it includes
the two-phase commit. Each configuration runs in its own ``torchrun`` launch; one unmeasured
checkpoint first warms the host cache and the page tables, then ``--repeats`` measured ones.

    python benchmarks/distributed.py                          # 1 GiB, 3 repeats (~1 min here)
    python benchmarks/distributed.py --total 128MiB --repeats 1   # smoke test
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

from harness.cli import parser
from harness.machine import start_run
from harness.paths import DEFAULT_YAML, REPO_ROOT, RESULTS_DIR, bench_root
from harness.report import Report, command_line, markdown_document
from harness.stats import median
from harness.units import fmt_bytes, fmt_s, gbps, parse_size

TENSOR_BYTES = 32 << 20  # each global tensor; rows split across ranks when sharded
LAYOUTS = [(1, "sharded"), (2, "sharded"), (2, "replicated")]  # 1 rank: both layouts are the same


def worker(root: Path, total: int, layout: str, repeats: int, out: Path) -> None:
    """One rank: build this rank's state, checkpoint it 1 + ``repeats`` times, report the timings."""
    import torch
    import torch.distributed as dist

    from tierstate import Runner, ShardInfo, TensorItem

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    rows, cols = TENSOR_BYTES // 4 // 1024, 1024
    mine = rows // world if layout == "sharded" else rows
    start = rank * mine if layout == "sharded" else 0
    gen = torch.Generator().manual_seed(rank if layout == "sharded" else 0)
    tensors = {f"w{i:04d}": torch.randn(mine, cols, generator=gen) * 0.02 for i in range(total // TENSOR_BYTES)}

    class Weights:
        def describe(self) -> list[TensorItem]:
            shard = ShardInfo((rows, cols), (start, 0)) if layout == "sharded" and world > 1 else None
            return [TensorItem(k, t, shard=shard, replicated=layout == "replicated") for k, t in tensors.items()]

        def restore(self, state: object) -> None:
            raise NotImplementedError("this benchmark only saves")

    settings = {"tiers": {"nvme": {"path": str(root / "nvme")}, "pfs": {"path": str(root / "pfs")}}}
    runner = Runner.from_yaml(DEFAULT_YAML, settings)
    runner.register(weights=Weights())
    timings, written = [], 0
    for step in range(repeats + 1):
        dist.barrier()
        started = time.perf_counter()
        result = runner.checkpoint(step).result()
        elapsed = torch.tensor([time.perf_counter() - started], dtype=torch.float64)
        dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)  # the checkpoint is durable when the slowest rank is
        if step:
            timings.append(elapsed.item())
        written = result.raw_bytes
        dist.barrier()
        if rank == 0:
            shutil.rmtree(result.path)  # keep the disk as empty as for the first run
    per_rank = [None] * world
    dist.all_gather_object(per_rank, written)
    runner.close()
    if rank == 0:
        out.write_text(json.dumps({"seconds": timings, "written_per_rank": per_rank}))
    dist.destroy_process_group()


def launch(nproc: int, layout: str, total: int, repeats: int, root: Path) -> dict:
    out = root / f"{nproc}-{layout}.json"
    command = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
        __file__, "--worker", "--root", str(root / f"{nproc}-{layout}"), "--total", str(total),
        "--layout", layout, "--repeats", str(repeats), "--out", str(out),
    ]  # fmt: skip
    subprocess.run(command, check=True, cwd=REPO_ROOT, env={**os.environ, "OMP_NUM_THREADS": "1"})
    return json.loads(out.read_text())


def report(total: int, repeats: int, runs: dict[str, dict]) -> Report:
    table = Report(
        "distributed",
        f"Time to durable, {fmt_bytes(total)} of float32 state in total, median of {repeats}",
        ["configuration", "time to durable", "GB/s", "written per rank", "vs 1 rank"],
    )
    base = median(runs["1 rank"]["seconds"])
    for name, run in runs.items():
        seconds = median(run["seconds"])
        per_rank = " / ".join(fmt_bytes(b) for b in run["written_per_rank"])
        table.add(name, fmt_s(seconds), f"{gbps(total, seconds):.2f}", per_rank, f"{base / seconds:.2f}x")
    return table


def main(argv: list[str] | None = None) -> int:
    cli = parser("distributed", __doc__, repeats=3)
    cli.add_argument("--total", default="1GiB", help="total state, e.g. 1GiB or 256MiB")
    cli.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    cli.add_argument("--root", type=Path, help=argparse.SUPPRESS)
    cli.add_argument("--layout", choices=["sharded", "replicated"], help=argparse.SUPPRESS)
    cli.add_argument("--out", type=Path, help=argparse.SUPPRESS)
    args = cli.parse_args(argv)
    total = max(TENSOR_BYTES, parse_size(args.total) // TENSOR_BYTES * TENSOR_BYTES)
    if args.worker:
        worker(args.root, total, args.layout, args.repeats, args.out)
        return 0
    facts = start_run()
    runs = {}
    with bench_root("distributed") as root:
        for nproc, layout in LAYOUTS:
            name = "1 rank" if nproc == 1 else f"{nproc} ranks, {layout}"
            runs[name] = launch(nproc, layout, total, args.repeats, root)
    text = markdown_document(command_line("distributed", argv), facts, [report(total, args.repeats, runs)])
    directory = args.results_dir or RESULTS_DIR
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "distributed.md").write_text(text)
    (directory / "distributed.json").write_text(json.dumps({"facts": facts, "total": total, "runs": runs}, indent=1))
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
