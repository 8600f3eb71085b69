"""Benchmark 5: extra memory while checkpointing, vs the host cache size, for every method.

One fresh subprocess per method (so each peak is its own and nothing freed by one method can be
reused by the next): it builds the GPT state, notes its RSS (the model state and the Python/torch
runtime), creates the checkpointer, resets the kernel's high-water mark (``/proc/self/clear_refs``)
and checkpoints ``--checkpoints`` times until durable. Peak extra = VmHWM - that baseline; for
tierstate it includes the host cache itself (allocated and touched once at start), so the target
is extra <= host cache + 10%. The page cache is not process memory and is not counted (tierstate
writes O_DIRECT and leaves none; torch.save and DCP leave the whole checkpoint in it).

    python benchmarks/memory.py                   # full GPT state, ~3 min
    python benchmarks/memory.py --preset small
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

from harness.cli import parser
from harness.gpt_state import build_gpt
from harness.machine import start_run
from harness.methods import make_checkpointer
from harness.paths import bench_root
from harness.report import Report, progress, publish
from harness.rss import peak_rss_bytes, reset_peak_rss, rss_bytes, trim_heap
from harness.tierstate_checkpointer import cache_for
from harness.timing import time_save
from harness.units import MiB, fmt_bytes

# (label, method, host cache: "state" = sized to hold the state, or bytes; codec)
VARIANTS: list[tuple[str, str, str | int, str]] = [
    ("tierstate, cache = state", "tierstate", "state", "none"),
    ("tierstate, cache 256 MiB", "tierstate", 256 * MiB, "none"),
    ("tierstate, cache 256 MiB, zstd", "tierstate", 256 * MiB, "zstd"),
    ("torch.save", "torch.save", 0, "none"),
    ("dcp.save", "dcp.save", 0, "none"),
    ("dcp.async_save", "dcp.async_save", 0, "none"),
    ("dcp.async_save+async-staging", "dcp.async_save+async-staging", 0, "none"),
]


def child(method: str, cache: str, codec: str, preset: str, checkpoints: int) -> dict[str, int | float]:
    """Runs in the subprocess: baseline, then the peak over ``checkpoints`` checkpoints."""
    state = build_gpt(preset)
    trim_heap()
    base = rss_bytes()
    nbytes = state.tensor_bytes
    cache_bytes = cache_for(nbytes) if cache == "state" else int(cache)
    with bench_root(f"memory-{method}") as root:
        ckpt = make_checkpointer(method, state, root, cache_bytes=cache_bytes, codec=codec)
        if method != "tierstate":
            cache_bytes = 0
        if not reset_peak_rss():
            raise SystemExit("cannot reset VmHWM (/proc/self/clear_refs): peaks would include the setup")
        durable = []
        for step in range(1, checkpoints + 1):
            durable.append(time_save(ckpt, step).durable_s)
            ckpt.clear()
        peak = peak_rss_bytes()
        ckpt.close()
    return {"base": base, "peak": peak, "extra": peak - base, "cache": cache_bytes, "state": nbytes,
            "durable_s": durable}


def main(argv: list[str] | None = None) -> int:
    cli = parser("memory", __doc__, preset="full")
    cli.add_argument("--checkpoints", type=int, default=2)
    cli.add_argument("--child", nargs=3, metavar=("METHOD", "CACHE", "CODEC"), help=argparse.SUPPRESS)
    args = cli.parse_args(argv)
    if args.child:
        print(json.dumps(child(*args.child, args.preset, args.checkpoints)))
        return 0
    facts = start_run()
    results = {}
    for label, method, cache, codec in VARIANTS:
        command = [sys.executable, str(Path(__file__).resolve()), "--preset", args.preset,
                   "--checkpoints", str(args.checkpoints), "--child", method, str(cache), codec]
        proc = subprocess.run(command, capture_output=True, text=True, check=False)
        if proc.returncode != 0:
            raise SystemExit(f"{label}: child failed:\n{proc.stderr}")
        results[label] = json.loads(proc.stdout.strip().splitlines()[-1])
        r = results[label]
        progress(f"{label:34s} extra {fmt_bytes(r['extra'])}")
    state = next(iter(results.values()))["state"]
    report = Report(
        "memory",
        f"Peak extra RSS while checkpointing {fmt_bytes(state)} of GPT state ({args.checkpoints} checkpoints, "
        "one subprocess per method)",
        ["method", "host cache", "peak extra RSS", "extra ÷ cache", "extra ÷ state", "within cache +10%"],
    )
    for label, r in results.items():
        cache = r["cache"]
        report.add(
            label, fmt_bytes(cache) if cache else "-", fmt_bytes(r["extra"]),
            f"{r['extra'] / cache:.2f}" if cache else "-", f"{r['extra'] / r['state']:.2f}",
            ("yes" if r["extra"] <= 1.1 * cache else "NO") if cache else "-",
        )
    report.note("baseline = RSS after building the model + AdamW state (gradients freed); peak = VmHWM after "
                "clear_refs, so it covers exactly the checkpointer's creation and its checkpoints")
    report.raw = {"results": results, "args": vars(args)}
    publish("memory", [report], facts, argv, args.results_dir)
    return 0


if __name__ == "__main__":
    sys.exit(main())
