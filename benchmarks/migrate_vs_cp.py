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

import argparse
import shutil
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from pydantic import ByteSize, TypeAdapter  # noqa: E402

from benchmarks.common import (  # noqa: E402
    DEFAULT_YAML,
    Report,
    bench_root,
    drop_caches,
    fmt_bytes,
    fmt_s,
    gbps,
    interleave,
    machine_facts,
    median,
    save_reports,
    settle,
    synthetic_state,
    warn_if_busy,
)
from tierstate.pipeline.runner import Runner  # noqa: E402
from tierstate.tiers.filesystem import FilesystemTier  # noqa: E402
from tierstate.tiers.migrate import migrate  # noqa: E402

METHODS = ["cp -r", "cp -r + sync", "tierstate migrate", "tierstate migrate --format hdf5"]


def _cp(source: Path, target: Path, durable: bool) -> None:
    subprocess.run(["cp", "-r", str(source), str(target)], check=True)
    if durable:  # coreutils sync with arguments fsyncs exactly those files
        subprocess.run(["sync", *map(str, sorted(target.iterdir())), str(target), str(target.parent)], check=True)


def _run(name: str, nvme: FilesystemTier, pfs: FilesystemTier, step: int) -> float:
    """Seconds for one copy of ``step`` from nvme to a fresh pfs by method ``name``."""
    shutil.rmtree(pfs.root, ignore_errors=True)
    pfs.root.mkdir(parents=True)
    settle()
    started = time.perf_counter()
    if name.startswith("cp"):
        _cp(nvme.step_dir(step), pfs.step_dir(step), durable=name.endswith("sync"))
    else:
        migrate(step, nvme, pfs, fmt="hdf5" if "hdf5" in name else None)
    return time.perf_counter() - started


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", default="1.5GiB", help="checkpoint size (default 1.5GiB)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--cold", action="store_true", help="drop the page cache before each run (root)")
    args = parser.parse_args(argv)
    warn_if_busy()
    size = int(TypeAdapter(ByteSize).validate_python(args.size))
    facts = machine_facts(Path("checkpoints"))
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
                parser.error("--cold needs permission to write /proc/sys/vm/drop_caches")
            seconds[name].append(_run(name, nvme, pfs, 1))
            print(f"round {repeat + 1} {name:32s} {seconds[name][-1]:.2f} s", file=sys.stderr, flush=True)
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
    report.print()
    save_reports("migrate_vs_cp", [report], facts, argv)
    return 0


if __name__ == "__main__":
    sys.exit(main())
