"""Benchmark: ``tierstate migrate`` next to ``cp -r`` of the same checkpoint directory.

Both copy one committed checkpoint from one tier directory to another on the same file system.
``cp -r`` only copies (the data may still sit in the page cache when it returns); ``cp -r + sync``
also fsyncs the copied files and the directory, i.e. is durable like migrate. ``tierstate
migrate`` copies frame by frame (``copy_file_range``), reads every frame back from the target and
checks its checksum, fsyncs, writes the manifest and renames the directory (the commit protocol).
``migrate --format hdf5`` rewrites the checkpoint as HDF5 instead (read, verify, write, verify).
Methods run interleaved A B C A B C; each starts after ``sync`` so no one pays for another's
writeback. The source is in the page cache for all (it was just written); with ``--cold`` (needs
root) the page cache is dropped before each run.

    python benchmarks/migrate_vs_cp.py                 # 1.5 GiB checkpoint, 3 rounds
    python benchmarks/migrate_vs_cp.py --size 64MiB --repeats 1   # smoke test
"""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

from harness.cli import parser
from harness.dict_state import synthetic_state
from harness.disk import drop_caches, settle
from harness.machine import start_run
from harness.paths import DEFAULT_YAML, bench_root, fresh_dir
from harness.report import Report, progress, publish
from harness.stats import interleave, median
from harness.units import fmt_bytes, fmt_s, gbps, parse_size

from tierstate import Runner
from tierstate.tiers.ops.migrate import migrate
from tierstate.tiers.storage.filesystem import FilesystemTier

METHODS = ["cp -r", "cp -r + sync", "tierstate migrate", "tierstate migrate --format hdf5"]


def _cp(source: Path, target: Path, durable: bool) -> None:
    subprocess.run(["cp", "-r", str(source), str(target)], check=True)
    if durable:  # coreutils sync with arguments fsyncs exactly those files
        subprocess.run(["sync", *map(str, sorted(target.iterdir())), str(target), str(target.parent)], check=True)


def _run(name: str, nvme: FilesystemTier, pfs: FilesystemTier, step: int) -> float:
    """Seconds for one copy of ``step`` from nvme to a fresh pfs by method ``name``."""
    fresh_dir(pfs.root)
    settle()
    started = time.perf_counter()
    if name.startswith("cp"):
        _cp(nvme.step_dir(step), pfs.step_dir(step), durable=name.endswith("sync"))
    else:
        migrate(step, nvme, pfs, fmt="hdf5" if "hdf5" in name else None)
    return time.perf_counter() - started


def main(argv: list[str] | None = None) -> int:
    cli = parser("migrate_vs_cp", __doc__, repeats=3)
    cli.add_argument("--size", default="1.5GiB", help="checkpoint size (default 1.5GiB)")
    cli.add_argument("--cold", action="store_true", help="drop the page cache before each run (root)")
    args = cli.parse_args(argv)
    size = parse_size(args.size)
    facts = start_run()
    seconds: dict[str, list[float]] = {name: [] for name in METHODS}
    with bench_root("migrate") as root:
        nvme, pfs = FilesystemTier("nvme", root / "nvme"), FilesystemTier("pfs", root / "pfs")
        runner = Runner.from_yaml(DEFAULT_YAML, {"tiers": {"nvme": {"path": str(nvme.root)}}})
        state = synthetic_state(size, 32 << 20)
        runner.register(**state.providers())
        runner.checkpoint(1).result()
        runner.close()
        del state
        stored = nvme.manifest(1).stored_bytes
        files = len(list(nvme.step_dir(1).iterdir()))
        for name in METHODS:  # warm-up, not timed
            _run(name, nvme, pfs, 1)
        for repeat, name in interleave(METHODS, args.repeats):
            if args.cold and not drop_caches():
                cli.error("--cold needs permission to write /proc/sys/vm/drop_caches")
            seconds[name].append(_run(name, nvme, pfs, 1))
            progress(f"round {repeat + 1} {name:32s} {seconds[name][-1]:.2f} s")
    cache = "dropped before each run" if args.cold else "source warm in the page cache"
    report = Report(
        "migrate_vs_cp",
        f"Copying one {fmt_bytes(stored)} checkpoint ({files} files) between two directories on one disk, "
        f"median of {args.repeats}, {cache}",
        ["method", "time", "GB/s", "durable", "verified"],
    )
    for name in METHODS:
        durable = "yes" if name != "cp -r" else "no"
        verified = "every frame, on the target" if name.startswith("tierstate") else "no"
        report.add(name, fmt_s(median(seconds[name])), f"{gbps(stored, median(seconds[name])):.2f}", durable, verified)
    report.raw = {"stored_bytes": stored, "seconds": seconds, "args": vars(args)}
    publish("migrate_vs_cp", [report], facts, argv, args.results_dir)
    return 0


if __name__ == "__main__":
    sys.exit(main())
