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
    python benchmarks/distributed.py --nodes                  # node-local NVMe: 1 node vs 2 simulated nodes

``--nodes`` measures node-local tiers instead: the persist tier is ``scope: node`` (each node its own
directory, ``{node}`` in its path) and the PFS receives every checkpoint by a flush from every node.
One node (one rank) against two simulated nodes (two ``torchrun --nnodes=2`` launches on this
machine, ``TIERSTATE_NODE=n0/n1``, one rank each, each holding half of the state as row shards):
"durable" is the commit of every node's part on its own NVMe, "on the PFS" the publication of the
global manifest there (every node's part copied).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
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
NODE_COUNTS = [1, 2]  # --nodes: simulated nodes of one rank each


def tier_settings(root: Path, nodes: bool) -> dict:
    """Tiers under ``root``: the default NVMe + PFS, or (``nodes``) a node-scoped NVMe flushed to a shared PFS."""
    if not nodes:
        return {"nvme": {"path": str(root / "nvme")}, "pfs": {"path": str(root / "pfs")}}
    return {
        "nvme": {"path": str(root / "{node}" / "nvme"), "scope": "node"},
        "pfs": {"path": str(root / "pfs"), "scope": "shared", "flush": {"every": 1}},
    }


def worker(root: Path, total: int, layout: str, repeats: int, out: Path, nodes: bool) -> None:
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

    def slowest(started: float) -> float:
        elapsed = torch.tensor([time.perf_counter() - started], dtype=torch.float64)
        dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)  # a checkpoint is durable when the slowest rank's part is
        return elapsed.item()

    runner = Runner.from_yaml(DEFAULT_YAML, {"tiers": tier_settings(root, nodes)})
    runner.register(weights=Weights())
    timings, on_pfs, written = [], [], 0
    for step in range(repeats + 1):
        dist.barrier()
        started = time.perf_counter()
        handle = runner.checkpoint(step)
        result = handle.result()
        durable = slowest(started)
        pfs_path = handle.tier_futures["pfs"].result() if nodes else None
        flushed = slowest(started) if nodes else None
        if step:
            timings.append(durable)
            if flushed is not None:
                on_pfs.append(flushed)
        written = result.raw_bytes
        dist.barrier()
        if rank == 0 or nodes:  # keep the disk as empty as for the first run (with nodes: each node its own part)
            shutil.rmtree(result.path)
        if rank == 0 and pfs_path is not None:
            shutil.rmtree(pfs_path)
    per_rank = [None] * world
    dist.all_gather_object(per_rank, written)
    runner.close()
    if rank == 0:
        out.write_text(json.dumps({"seconds": timings, "on_pfs": on_pfs, "written_per_rank": per_rank}))
    dist.destroy_process_group()


def worker_args(root: Path, name: str, total: int, layout: str, repeats: int, out: Path) -> list[str]:
    return [
        __file__, "--worker", "--root", str(root / name), "--total", str(total), "--layout", layout,
        "--repeats", str(repeats), "--out", str(out),
    ]  # fmt: skip


def launch(nproc: int, layout: str, total: int, repeats: int, root: Path) -> dict:
    out = root / f"{nproc}-{layout}.json"
    command = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
        *worker_args(root, f"{nproc}-{layout}", total, layout, repeats, out),
    ]  # fmt: skip
    subprocess.run(command, check=True, cwd=REPO_ROOT, env={**os.environ, "OMP_NUM_THREADS": "1"})
    return json.loads(out.read_text())


def launch_nodes(nodes: int, total: int, repeats: int, root: Path) -> dict:
    """``nodes`` torchrun launches, one per simulated node (one rank each), run together to the end."""
    out = root / f"{nodes}-nodes.json"
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    args = [*worker_args(root, f"{nodes}-nodes", total, "sharded", repeats, out), "--nodes"]
    launches = [
        subprocess.Popen(
            [sys.executable, "-m", "torch.distributed.run", f"--nnodes={nodes}", "--nproc_per_node=1",
             f"--node_rank={node}", "--master_addr=127.0.0.1", f"--master_port={port}", *args],
            cwd=REPO_ROOT, env={**os.environ, "OMP_NUM_THREADS": "1", "TIERSTATE_NODE": f"n{node}"},
        )
        for node in range(nodes)
    ]  # fmt: skip
    codes = [p.wait() for p in launches]
    if any(codes):
        raise SystemExit(f"{nodes} nodes: launches exited with {codes}")
    return json.loads(out.read_text())


def report(total: int, repeats: int, runs: dict[str, dict]) -> Report:
    table = Report(
        "distributed",
        f"Time to durable, {fmt_bytes(total)} of float32 state in total, median of {repeats}",
        ["configuration", "time to durable", "GB/s", "on the PFS", "written per rank", "vs the first"],
    )
    base = median(next(iter(runs.values()))["seconds"])
    for name, run in runs.items():
        seconds = median(run["seconds"])
        on_pfs = fmt_s(median(run["on_pfs"])) if run.get("on_pfs") else "-"
        per_rank = " / ".join(fmt_bytes(b) for b in run["written_per_rank"])
        table.add(name, fmt_s(seconds), f"{gbps(total, seconds):.2f}", on_pfs, per_rank, f"{base / seconds:.2f}x")
    return table


def main(argv: list[str] | None = None) -> int:
    cli = parser("distributed", __doc__, repeats=3)
    cli.add_argument("--total", default="1GiB", help="total state, e.g. 1GiB or 256MiB")
    cli.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    cli.add_argument("--root", type=Path, help=argparse.SUPPRESS)
    cli.add_argument("--layout", choices=["sharded", "replicated"], help=argparse.SUPPRESS)
    cli.add_argument("--out", type=Path, help=argparse.SUPPRESS)
    cli.add_argument("--nodes", action="store_true", help="node-local NVMe: 1 node vs 2 simulated nodes")
    args = cli.parse_args(argv)
    total = max(TENSOR_BYTES, parse_size(args.total) // TENSOR_BYTES * TENSOR_BYTES)
    if args.worker:
        worker(args.root, total, args.layout, args.repeats, args.out, args.nodes)
        return 0
    facts = start_run()
    runs = {}
    with bench_root("distributed") as root:
        if args.nodes:
            for nodes in NODE_COUNTS:
                runs[f"{nodes} node{'s' if nodes > 1 else ''}, node-local NVMe"] = launch_nodes(
                    nodes, total, args.repeats, root
                )
        else:
            for nproc, layout in LAYOUTS:
                name = "1 rank" if nproc == 1 else f"{nproc} ranks, {layout}"
                runs[name] = launch(nproc, layout, total, args.repeats, root)
    text = markdown_document(command_line("distributed", argv), facts, [report(total, args.repeats, runs)])
    directory = args.results_dir or RESULTS_DIR
    directory.mkdir(parents=True, exist_ok=True)
    name = "distributed-nodes" if args.nodes else "distributed"
    (directory / f"{name}.md").write_text(text)
    (directory / f"{name}.json").write_text(json.dumps({"facts": facts, "total": total, "runs": runs}, indent=1))
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
