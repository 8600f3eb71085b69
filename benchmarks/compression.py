"""Compression that pays? byte-shuffle + zstd on real trained weights and AdamW moments.

The example GPT (preset ``medium`` by default) is trained ``--train-steps`` steps first, so the
weights have moved off their init and the moments hold real gradient statistics. Then:

1. Codec table: each kind of tensor (fp32 weights, the same weights as bf16 and fp16, exp_avg,
   exp_avg_sq) is packed into 16 MiB chunks as the pipeline does and compressed chunk by chunk with
   ``tiers.format.codecs.compress``: ratio and single-thread throughput, byte-shuffle by element size
   (``shuffle: auto``) vs none, zstd levels 1 and 3.
2. End to end through the runner, interleaved: time to durable with ``codec: none`` vs ``zstd`` on
   a tier throttled to 100 MB/s (``persist.bandwidth: 100MB``, a share of a slow or shared file
   system) and unthrottled on the local disk, for the training state (fp32 model + AdamW) and for
   bf16 weights.

    python benchmarks/compression.py              # ~3 min
    python benchmarks/compression.py --preset small --train-steps 5 --repeats 1
"""

from __future__ import annotations

import sys
import time

import torch
from harness.cli import parser
from harness.dict_state import DictState
from harness.gpt_state import build_gpt
from harness.machine import start_run
from harness.methods import closing_all, make_checkpointer
from harness.paths import bench_root
from harness.report import Report, progress, publish
from harness.stats import interleave, median
from harness.tierstate_checkpointer import cache_for
from harness.timing import time_save, warm_up
from harness.units import MiB, fmt_bytes, fmt_ratio, fmt_s, gbps, parse_size

from tierstate.tiers.format import codecs

CHUNK = 16 * MiB


def chunks_of(tensors: list[torch.Tensor], chunk: int = CHUNK) -> list[memoryview]:
    """The tensors' bytes end to end, cut into ``chunk``-byte pieces (the pipeline's packing)."""
    flat = torch.cat([t.detach().reshape(-1).view(torch.uint8) for t in tensors])
    return [memoryview(flat[i : i + chunk].numpy()) for i in range(0, flat.numel(), chunk)]


def codec_row(pieces: list[memoryview], width: int, level: int) -> dict[str, float]:
    """Ratio and single-thread MB/s of compress and decompress over all chunks."""
    raw = stored = 0
    encoded = []
    started = time.perf_counter()
    for piece in pieces:
        packed = codecs.compress(piece, level, 0, width)
        encoded.append((packed, len(piece)))
        raw += len(piece)
        stored += len(packed.data) if packed else len(piece)
    compress_s = time.perf_counter() - started
    started = time.perf_counter()
    for packed, length in encoded:
        if packed is not None:
            codecs.decompress(packed.data, packed.codec, length, packed.shuffle)
    decompress_s = time.perf_counter() - started
    return {"ratio": raw / stored, "compress_mbps": raw / compress_s / 1e6,
            "decompress_mbps": raw / decompress_s / 1e6, "raw": raw, "stored": stored}


def main(argv: list[str] | None = None) -> int:
    cli = parser("compression", __doc__, preset="medium", repeats=3)
    cli.add_argument("--train-steps", type=int, default=60)
    cli.add_argument("--lr", type=float, default=3e-3)
    cli.add_argument("--bandwidth", default="100MB", help="throttled tier bandwidth")
    cli.add_argument("--level", type=int, default=1, help="zstd level of the time-to-durable runs")
    args = cli.parse_args(argv)
    facts = start_run()
    started = time.perf_counter()
    state = build_gpt(args.preset, warm_steps=args.train_steps, lr=args.lr)
    train_s = time.perf_counter() - started
    params = list({id(p): p for p in state.model.parameters()}.values())
    moments = [s for s in state.optimizer.state.values()]
    kinds = {
        "weights fp32": [p.detach() for p in params],
        "weights bf16": [p.detach().to(torch.bfloat16) for p in params],
        "weights fp16": [p.detach().to(torch.float16) for p in params],
        "AdamW exp_avg fp32": [m["exp_avg"] for m in moments],
        "AdamW exp_avg_sq fp32": [m["exp_avg_sq"] for m in moments],
    }
    codec_report = Report(
        "compression-codec",
        f"byte-shuffle + zstd on the example GPT ({state.n_params / 1e6:.1f} M params) after {args.train_steps} "
        f"AdamW steps; {CHUNK // MiB} MiB chunks, one thread",
        ["tensors", "bytes", "shuffle+zstd-1", "shuffle+zstd-3", "zstd-3 (no shuffle)",
         "compress MB/s (shuffle, 3)", "decompress MB/s", "compress MB/s (shuffle, 1)"],
    )
    codec_raw = {}
    for kind, tensors in kinds.items():
        pieces = chunks_of(tensors)
        width = tensors[0].element_size()
        r1 = codec_row(pieces, width, 1)
        r3 = codec_row(pieces, width, 3)
        n3 = codec_row(pieces, 1, 3)
        codec_report.add(kind, fmt_bytes(r3["raw"]), f"{r1['ratio']:.3f}", f"{r3['ratio']:.3f}", f"{n3['ratio']:.3f}",
                         f"{r3['compress_mbps']:.0f}", f"{r3['decompress_mbps']:.0f}", f"{r1['compress_mbps']:.0f}")
        codec_raw[kind] = {"zstd1_shuffle": r1, "zstd3_shuffle": r3, "zstd3_plain": n3}
        progress(f"{kind}: ratio {r3['ratio']:.3f}")
    codec_report.note(f"trained {args.train_steps} steps at lr {args.lr} in {train_s:.0f} s (the moments are real); "
                      "ratio = raw / stored bytes; a chunk that does not shrink is stored raw (ratio 1 for it)")
    codec_report.raw = codec_raw

    bf16 = DictState({f"w{i:03d}": t for i, t in enumerate(kinds["weights bf16"])})
    states = {"training state (fp32 model + AdamW)": state, "weights bf16": bf16}
    bandwidth = parse_size(args.bandwidth)
    variants = [(f"{label}, {codec}, {tier}", label, codec, bw)
                for label in states for tier, bw in ((f"{bandwidth / 1e6:.0f} MB/s tier", bandwidth),
                                                     ("local disk", None))
                for codec in ("none", "zstd")]
    e2e = Report(
        "compression-e2e",
        f"Time to durable with and without compression (median of {args.repeats}, interleaved)",
        ["state", "tier", "codec", "bytes", "stored", "ratio", "time to durable", "GB/s (raw)", "none÷zstd"],
    )
    seconds: dict[str, list[float]] = {name: [] for name, *_ in variants}
    stored: dict[str, int] = {}
    with (
        bench_root("compression") as root,
        closing_all({name: make_checkpointer(f"tierstate-{i}", states[label], root,
                                             cache_bytes=cache_for(states[label].tensor_bytes), codec=codec,
                                             bandwidth=bw, level=args.level)
                     for i, (name, label, codec, bw) in enumerate(variants)}) as ckpts,
    ):
        warm_up(ckpts.values())
        for repeat, name in interleave(list(ckpts), args.repeats):
            ckpts[name].clear()
            seconds[name].append(time_save(ckpts[name], repeat + 1).durable_s)
            stored[name] = ckpts[name].result(repeat + 1).stored_bytes
            progress(f"round {repeat + 1} {name}: {seconds[name][-1]:.2f} s")
    for name, label, codec, bw in variants:
        nbytes = states[label].tensor_bytes
        t = median(seconds[name])
        partner = name.replace(", zstd,", ", none,")
        e2e.add(label, f"{bw / 1e6:.0f} MB/s" if bw else "local disk", codec, fmt_bytes(nbytes),
                fmt_bytes(stored[name]), f"{nbytes / stored[name]:.3f}", fmt_s(t), f"{gbps(nbytes, t):.2f}",
                fmt_ratio(median(seconds[partner]) / t) if codec == "zstd" else "-")
    e2e.note(f"tierstate, zstd level {args.level}, shuffle auto, 2 compress workers, host cache sized to hold the "
             "state; the throttle paces the bytes actually written (stored bytes)")
    e2e.raw = {"seconds": seconds, "stored": stored, "args": vars(args)}
    publish("compression", [codec_report, e2e], facts, argv, args.results_dir)
    return 0


if __name__ == "__main__":
    sys.exit(main())
