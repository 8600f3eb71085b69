"""Benchmark 6, for a machine with a CUDA GPU: device->host capture bandwidth and blocked time.

1. Capture bandwidth: ``--capture-gb`` of fp32 tensors (64 MiB each) on the GPU. Baseline: one
   plain pinned ``copy_(non_blocking=True)`` per tensor into a preallocated pinned buffer, then a
   synchronize -- the best a device->host copy of these bytes can do. tierstate: ``checkpoint()``
   until ``captured`` (side CUDA stream into pinned host-cache slabs, ``--chunk-mb`` each), with a
   host cache that holds the whole state; and ``tierstate(memory)``: the same into a memory tier in
   /dev/shm, captured straight into its slots (mapped files registered with ``cudaHostRegister``),
   until ``captured`` and until committed there. Reported: GB/s of each and their ratio, medians.
2. Blocked time in a GPU training loop: the example GPT on the GPU (``--d-model``/``--layers``),
   checkpointing every ``--every`` steps, methods interleaved A B A B: none, tierstate (lazy: the
   copies overlap the next forward/backward, the optimizer pre-hook waits only if they are still
   running), torch.save (+fsync), DCP async_save with its default staging and with a pinned,
   non-blocking, asynchronous DefaultStager (``--methods`` picks; torch 2.11's DefaultStager failed on
   this state with ``KeyError: <class 'type'>`` in its deepcopy). Blocked seconds per checkpoint and
   training slowdown vs none.

Without CUDA it exits with status 2 and says so; ``--device cpu`` runs the same code on the CPU as
a smoke test of the script only (its numbers mean nothing for GPUs).

    python benchmarks/gpu.py                      # defaults sized for ~5 min on one H100/H200
    python benchmarks/gpu.py --capture-gb 1 --d-model 512 --layers 4 --steps 9 --every 3 --repeats 1
    python benchmarks/gpu.py --device cpu --capture-gb 0.2 --d-model 256 --layers 2 --repeats 1  # CPU smoke test
"""

from __future__ import annotations

import argparse
import math
import shutil
import sys
import time
from pathlib import Path

import torch
from harness.blocked_table import blocked_report
from harness.checkpointer import Checkpointer
from harness.cli import parser
from harness.dict_state import DictState
from harness.gpt_state import GPTState, build_gpt
from harness.machine import start_run
from harness.methods import closing_all, make_checkpointers, setups
from harness.paths import BENCH_ROOT, bench_root
from harness.report import Report, progress, publish
from harness.stats import interleave, median
from harness.tierstate_checkpointer import cache_for
from harness.timing import time_save, warm_up
from harness.training import train_rounds
from harness.units import GB, MiB, fmt_bytes, fmt_ratio, fmt_s, gbps

from examples.gpt import GPTConfig

METHODS = ["none", "tierstate", "torch.save", "dcp.async_save", "dcp.async_save+async-staging"]
#: What the capture part times against the plain pinned copy, and how each captures.
CAPTURED = {
    "tierstate": "chunk slabs of the pinned host cache, side stream",
    "tierstate(memory)": "straight into the memory tier's registered slots, side stream",
}


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def plain_pinned_copy(tensors: list[torch.Tensor], dst: torch.Tensor) -> float:
    """Seconds for the reference copy: every tensor's bytes into one pinned buffer, one synchronize."""
    sync(tensors[0].device)
    started = time.perf_counter()
    offset = 0
    for t in tensors:
        n = t.numel() * t.element_size()
        dst[offset : offset + n].copy_(t.reshape(-1).view(torch.uint8), non_blocking=True)
        offset += n
    sync(tensors[0].device)
    return time.perf_counter() - started


def capture_bandwidth(args: argparse.Namespace, device: torch.device, root: Path) -> Report:
    numel = 64 * MiB // 4
    count = max(1, int(args.capture_gb * GB) // (64 * MiB))
    tensors = {f"t{i:04d}": torch.randn(numel, device=device) for i in range(count)}
    state = DictState(tensors)
    nbytes = state.tensor_bytes
    pinned = device.type == "cuda"
    dst = torch.empty(nbytes, dtype=torch.uint8, pin_memory=pinned)
    plain: list[float] = []
    captured: dict[str, list[float]] = {name: [] for name in CAPTURED}
    durable: dict[str, list[float]] = {name: [] for name in CAPTURED}
    chunk = args.chunk_mb * MiB
    with closing_all(make_checkpointers(CAPTURED, state, root, cache_bytes=cache_for(nbytes, chunk),
                                        chunk_bytes=chunk)) as ckpts:
        plain_pinned_copy(list(tensors.values()), dst)  # warm-up of all: pinning, slots allocated and registered
        warm_up(ckpts.values())
        for repeat, name in interleave(["plain", *CAPTURED], args.repeats):
            if name == "plain":
                plain.append(plain_pinned_copy(list(tensors.values()), dst))
                progress(f"round {repeat + 1} plain: {plain[-1]:.3f} s")
                continue
            ckpt = ckpts[name]
            sync(device)
            record = ckpt.save(repeat + 1)
            ckpt.wait_staged()
            captured[name].append(time.perf_counter() - record.requested)
            ckpt.drain()
            durable[name].append(time.perf_counter() - record.requested)
            ckpt.clear()
            progress(f"round {repeat + 1} {name}: {captured[name][-1]:.3f} s")
    report = Report(
        "gpu-capture",
        f"Device->host capture of {fmt_bytes(nbytes)} ({count} x 64 MiB fp32 on {device}), median of {args.repeats}",
        ["method", "seconds", "GB/s", "÷ plain pinned copy_"],
    )
    p = median(plain)
    report.add("plain pinned copy_ (one buffer, non_blocking, 1 sync)", fmt_s(p), f"{gbps(nbytes, p):.2f}", "1.00x")
    for name, what in CAPTURED.items():
        c, d = median(captured[name]), median(durable[name])
        report.add(f"{name} capture ({what})", fmt_s(c), f"{gbps(nbytes, c):.2f}", fmt_ratio(c / p))
        report.add(f"{name} request -> durable", fmt_s(d), f"{gbps(nbytes, d):.2f}", "-")
    report.note(f"host cache and slots {'pinned' if pinned else 'NOT pinned (cpu smoke test)'}; the cache holds "
                "the state; the memory tier is in /dev/shm, keep_last 1")
    report.raw = {"bytes": nbytes, "plain": plain, "captured": captured, "durable": durable}
    del tensors, state, dst
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return report


def auto_interval(state: GPTState, tierstate: Checkpointer, device: torch.device) -> int:
    """Steps between checkpoints for 1.5x tierstate's time to durable, so no checkpoint must queue."""
    sync(device)
    started = time.perf_counter()
    for _ in range(5):
        state.train_step()
    sync(device)
    step_s = (time.perf_counter() - started) / 5
    durable_s = time_save(tierstate, 0).durable_s
    tierstate.clear()
    tierstate.records.clear()
    every = max(3, math.ceil(1.5 * durable_s / step_s))
    progress(f"auto interval: step {step_s * 1e3:.1f} ms, tierstate durable {durable_s:.2f} s -> every {every} steps")
    return every


def training_loop(args: argparse.Namespace, device: torch.device, root: Path) -> Report:
    config = GPTConfig(d_model=args.d_model, n_layers=args.layers, n_heads=max(1, args.d_model // 128),
                       seq_len=args.seq_len, dropout=0.0)
    state = build_gpt(config, batch_size=args.batch_size, device=device)
    nbytes = state.tensor_bytes
    cache = cache_for(nbytes, args.chunk_mb * MiB)
    methods = args.methods.split(",")
    with closing_all(make_checkpointers(methods, state, root, cache_bytes=cache, chunk_bytes=args.chunk_mb * MiB,
                                        optimizer=state.optimizer)) as ckpts:
        warm_up(ckpts.values())  # allocations, pinning, first-use costs: not timed
        for _ in range(3):
            state.train_step()
        if not args.every:  # auto: an interval 1.5x as long as tierstate's time to durable, so none must queue
            args.every = auto_interval(state, ckpts["tierstate"], device)
        if not args.steps:
            args.steps = 3 * args.every  # two checkpoints per run, the last interval without one
        runs = train_rounds(state, ckpts, args.steps, args.every, args.repeats, sync=lambda: sync(device))
        setup = setups(ckpts)
    report = blocked_report(
        "gpu-blocked",
        f"GPU training loop on {device}: GPT {state.n_params / 1e6:.0f} M params, state {fmt_bytes(nbytes)}, "
        f"checkpoint every {args.every} steps, {args.steps} steps x {args.repeats} rounds",
        runs,
        next((m for m in reversed(methods) if m.startswith("dcp")), methods[-1]),  # the best-staged DCP run
        args.every,
        setup,
    )
    report.raw.update({"state_bytes": nbytes, "cache_bytes": cache, "args": vars(args)})
    return report


def main(argv: list[str] | None = None) -> int:
    cli = parser("gpu", __doc__, repeats=2, methods=METHODS, tag=True)
    cli.add_argument("--device", default="cuda", help="cuda (default) or cpu (smoke test of this script only)")
    cli.add_argument("--capture-gb", type=float, default=8.0)
    cli.add_argument("--chunk-mb", type=int, default=64, help="tierstate chunk_size in MiB")
    cli.add_argument("--d-model", type=int, default=1536)
    cli.add_argument("--layers", type=int, default=12)
    cli.add_argument("--seq-len", type=int, default=256)
    cli.add_argument("--batch-size", type=int, default=16)
    cli.add_argument("--steps", type=int, default=0, help="steps per run; 0: 3 x --every")
    cli.add_argument("--every", type=int, default=0,
                        help="checkpoint interval in steps; 0: auto, 1.5x tierstate's time to durable")
    cli.add_argument("--skip-capture", action="store_true")
    cli.add_argument("--skip-training", action="store_true")
    args = cli.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        print("benchmarks/gpu.py needs a CUDA GPU: torch.cuda.is_available() is False on this machine "
              f"(torch {torch.__version__}, CUDA build: {torch.version.cuda or 'none'}). Run it on a GPU machine, "
              "or pass --device cpu to smoke-test the script (numbers meaningless).", file=sys.stderr)
        return 2
    device = torch.device(args.device)
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    facts = start_run()
    if device.type == "cuda":
        facts["gpu"] = f"{torch.cuda.get_device_name(device)}, " \
                       f"{torch.cuda.get_device_properties(device).total_memory / 2**30:.0f} GiB"
    facts["disk_free"] = fmt_bytes(shutil.disk_usage(BENCH_ROOT).free)
    reports = []
    with bench_root("gpu") as root:
        if not args.skip_capture:
            reports.append(capture_bandwidth(args, device, root))
        if not args.skip_training:
            reports.append(training_loop(args, device, root))
    publish("gpu", reports, facts, argv, args.results_dir, tag=args.tag if device.type == "cuda" else "cpu-smoke")
    return 0


if __name__ == "__main__":
    sys.exit(main())
