"""Benchmark 4: how save times scale with the state: 10 MB .. several GB, many small vs few large
tensors, a host cache smaller than the state, with and without compression.

States are synthetic (weight-like fp32 values, normal with std 0.02), so any size and shape can be
built. For every case each method saves the same state, interleaved over ``--repeats`` rounds, and
the table shows for each: "free after" = from the request until the state may change again (the
longest a trainer can be blocked: tierstate's capture, DCP async_save's staging copy, the whole
save for synchronous methods) and "durable" = until committed on disk. Compressed cases run only
tierstate (the competitors have no compression; their numbers are the uncompressed row's).

    python benchmarks/scaling.py                   # up to 4 GB, ~8 min
    python benchmarks/scaling.py --max-gb 0.2 --repeats 1   # smoke test
"""

from __future__ import annotations

import gc
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from harness.cli import parser
from harness.dict_state import synthetic_state
from harness.disk import disk_write_seconds
from harness.machine import start_run
from harness.methods import closing_all, make_checkpointers
from harness.paths import bench_root
from harness.report import Report, progress, publish
from harness.stats import interleave, median
from harness.tierstate_checkpointer import cache_for
from harness.timing import SaveTiming, time_save, warm_up
from harness.units import GB, GiB, MiB, fmt_bytes, fmt_ratio, fmt_s, gbps

COMPETITORS = ["torch.save", "dcp.save", "dcp.async_save"]
CACHE_CAP = 2 * GiB  # the largest host cache the sweep allocates, to stay well inside this machine's RAM


@dataclass(frozen=True)
class Case:
    label: str
    total: int
    tensor: int
    cache: int | None = None  # None: sized to hold the state (capped at CACHE_CAP)
    codec: str = "none"
    competitors: bool = True


def cases(max_bytes: int) -> list[Case]:
    sweep = [int(s * GB) for s in (0.01, 0.1, 1, 2, 4, 8) if s * GB <= max_bytes]
    out = [Case(f"{fmt_bytes(total)} few large", total, min(64 * MiB, max(total // 4, 4096))) for total in sweep]
    small = 10_000 * 4096
    out += [
        Case("10^4 x 4 KB", small, 4096),
        Case("4 x 10 MB (same bytes)", small, small // 4),
    ]
    big = min(int(1 * GB), max_bytes)
    out += [
        Case(f"{fmt_bytes(big)}, cache 128 MiB < state", big, 64 * MiB, cache=128 * MiB),
        Case(f"{fmt_bytes(big)}, zstd", big, 64 * MiB, codec="zstd", competitors=False),
        Case(f"{fmt_bytes(big)}, cache 128 MiB, zstd", big, 64 * MiB, cache=128 * MiB, codec="zstd", competitors=False),
    ]
    return out


def run_case(case: Case, root: Path, repeats: int) -> tuple[dict[str, list[SaveTiming]], int, int]:
    state = synthetic_state(case.total, case.tensor)
    nbytes = state.tensor_bytes
    cache = case.cache or min(cache_for(nbytes), CACHE_CAP)
    names = ["tierstate"] + (COMPETITORS if case.competitors else [])
    timings: dict[str, list[SaveTiming]] = {name: [] for name in names}
    with closing_all(make_checkpointers(names, state, root, cache_bytes=cache, codec=case.codec)) as ckpts:
        warm_up(ckpts.values())
        for repeat, name in interleave(names, repeats):
            ckpts[name].clear()
            timings[name].append(time_save(ckpts[name], repeat + 1))
    del state, ckpts
    gc.collect()
    return timings, nbytes, cache


def reports_from(raw: dict[str, Any], disk_bw: float, repeats: int) -> list[Report]:
    """Two tables from the raw timings: how long the state is held (free after) and time to durable."""
    free = Report("scaling-free", f"Scaling: request -> state free again (worst-case blocked), median of {repeats}",
                  ["case", "tensors", "host cache", "tierstate", "torch.save", "dcp.save", "dcp.async_save",
                   "dcp.async÷tierstate", "torch.save÷tierstate"])
    durable = Report("scaling-durable", f"Scaling: request -> durable, median of {repeats}",
                     ["case", "bytes", "tierstate", "GB/s", "÷ bytes/disk bw", "torch.save", "dcp.save",
                      "dcp.async_save", "torch.save÷tierstate", "dcp.save÷tierstate"])
    for label, case in raw.items():
        med = {name: (median(t["staged_s"] for t in ts), median(t["durable_s"] for t in ts))
               for name, ts in case["timings"].items()}
        codec = f" ({case['codec']})" if case["codec"] != "none" else ""
        t_free, t_dur = med["tierstate"]

        def cell(name: str, i: int, med: dict = med) -> str:
            return fmt_s(med[name][i]) if name in med else "as above"

        def ratio(name: str, i: int, mine: float, med: dict = med) -> str:
            return fmt_ratio(med[name][i] / mine) if name in med else "-"

        free.add(label, str(case["tensors"]), fmt_bytes(case["cache"]), fmt_s(t_free) + codec,
                 cell("torch.save", 0), cell("dcp.save", 0), cell("dcp.async_save", 0),
                 ratio("dcp.async_save", 0, t_free), ratio("torch.save", 0, t_free))
        durable.add(label, fmt_bytes(case["bytes"]), fmt_s(t_dur) + codec, f"{gbps(case['bytes'], t_dur):.2f}",
                    fmt_ratio(t_dur * disk_bw / case["bytes"]), cell("torch.save", 1), cell("dcp.save", 1),
                    cell("dcp.async_save", 1), ratio("torch.save", 1, t_dur), ratio("dcp.save", 1, t_dur))
    free.note("free after = request -> the state may change again: tierstate's capture into the host cache (in a "
              "training loop this overlaps forward/backward, so the trainer waits far less, see blocked.py); DCP "
              "async_save's synchronous staging copy; the whole save for torch.save and dcp.save")
    free.note(f"host cache sized to hold the state (+6%), capped at {fmt_bytes(CACHE_CAP)}, unless the case says "
              "otherwise; a cache smaller than the state makes capture wait for persist (backpressure)")
    durable.note(f"disk O_DIRECT write measured in this run: {disk_bw / GB:.2f} GB/s (1 GiB, best of 2); "
                 "compressed cases run tierstate only (the competitors have no compression: see the rows above)")
    durable.raw = {"disk_bw": disk_bw, "cases": raw}
    return [free, durable]


def main(argv: list[str] | None = None) -> int:
    cli = parser("scaling", __doc__, repeats=2)
    cli.add_argument("--max-gb", type=float, default=4.0, help="largest state of the size sweep")
    args = cli.parse_args(argv)
    facts = start_run()
    raw: dict[str, Any] = {}
    with bench_root("scaling") as root:
        probe = root / "disk-probe.bin"
        disk_s = min(disk_write_seconds(probe, GiB, direct=True) for _ in range(2))
        probe.unlink()
        disk_bw = GiB / disk_s
        for case in cases(int(args.max_gb * GB)):
            timings, nbytes, cache = run_case(case, root, args.repeats)
            raw[case.label] = {"bytes": nbytes, "cache": cache, "codec": case.codec,
                               "tensors": max(1, case.total // case.tensor),
                               "timings": {n: [vars(t) for t in ts] for n, ts in timings.items()}}
            progress(f"{case.label}: " + ", ".join(
                f"{n} {median(t.staged_s for t in ts):.3f}/{median(t.durable_s for t in ts):.3f} s"
                for n, ts in timings.items()))
    reports = reports_from(raw, disk_bw, args.repeats)
    reports[-1].raw["args"] = vars(args)
    publish("scaling", reports, facts, argv, args.results_dir)
    return 0


if __name__ == "__main__":
    sys.exit(main())
