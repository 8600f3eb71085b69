"""Benchmark 1: how long each checkpoint blocks a real training loop, and how much it slows training.

The example GPT (preset ``full``: ~126 M parameters, params + AdamW moments ~1.5 GB) trains on the
CPU; after every ``--every``-th step one method checkpoints its full state (model + optimizer state
dicts). Methods, each run the same steps, interleaved A B C A B C for ``--repeats`` rounds:

* ``none``: the same loop without checkpoints (the slowdown baseline),
* ``tierstate``: lazy capture into a host cache sized to hold the whole state, O_DIRECT persist,
* ``torch.save`` + fsync + rename (synchronous),
* ``dcp.save`` (synchronous), ``dcp.async_save`` (default: synchronous staging copy, background write),
* ``dcp.async_save+async-staging`` (a reused ``DefaultStager`` staging in a background thread; the
  trainer waits for the copy before the next ``optimizer.step()``, the same overlap as tierstate),
* by name only: ``copy-floor`` (a background memcpy into reused memory, nothing else),
  ``tierstate(memory)`` / ``tierstate(memory-no-slots)`` (a memory tier in /dev/shm, captured into its slots
  or not), ``tierstate(memory-16KiB)`` (that memory tier checkpointing a 16 KiB module beside the same
  training: what a checkpoint costs the trainer whatever its size).

Blocked time = the checkpoint call + any wait before the next ``optimizer.step()`` (+ the wait for
the previous checkpoint when a new one is requested too early). Slowdown = the loop's wall time
over the ``none`` run of the same round, minus one. Each method's first checkpoint is a warm-up
outside the timed runs (DCP's stager allocates its staging copy then; tierstate its runner).

    python benchmarks/blocked.py                 # full size, ~7 min
    python benchmarks/blocked.py --methods none,tierstate --steps 30 --every 10 --tag every10   # interval 10
    python benchmarks/blocked.py --preset small --steps 6 --every 2 --repeats 1   # smoke test
    python benchmarks/blocked.py --model bn --methods none,tierstate,torch.save   # BatchNorm net

``--model bn`` trains a convolutional net with BatchNorm instead (harness/bn_state.py): its running
statistics change in every forward, so tierstate copies them before ``checkpoint()`` returns.
"""

from __future__ import annotations

import sys

import torch
from harness.blocked_table import blocked_report
from harness.bn_state import build_bn_net
from harness.cli import parser
from harness.competitors import CUDA
from harness.gpt_state import build_gpt
from harness.machine import start_run
from harness.methods import closing_all, make_checkpointers, setups
from harness.paths import bench_root
from harness.report import publish
from harness.tierstate_checkpointer import cache_for
from harness.timing import warm_up
from harness.training import train_rounds
from harness.units import GiB, fmt_bytes

METHODS = [
    "none", "copy-floor", "tierstate", "torch.save", "dcp.save", "dcp.async_save", "dcp.async_save+async-staging"
]


def main(argv: list[str] | None = None) -> int:
    cli = parser("blocked", __doc__, preset="full", repeats=3, methods=METHODS, tag=True)
    cli.add_argument("--steps", type=int, default=15, help="training steps per run")
    cli.add_argument("--every", type=int, default=5, help="checkpoint after every N-th step")
    cli.add_argument("--batch-size", type=int, default=4)
    cli.add_argument("--threads", type=int, default=torch.get_num_threads())
    cli.add_argument("--model", choices=["gpt", "bn"], default="gpt", help="the example GPT or a BatchNorm conv net")
    args = cli.parse_args(argv)
    facts = start_run()
    torch.set_num_threads(args.threads)
    methods = args.methods.split(",")

    state = build_gpt(args.preset, batch_size=args.batch_size) if args.model == "gpt" else build_bn_net(args.preset)
    nbytes = state.tensor_bytes
    cache = cache_for(nbytes)
    with (
        bench_root("blocked") as root,
        closing_all(make_checkpointers(methods, state, root, cache_bytes=cache, optimizer=state.optimizer)) as ckpts,
    ):
        warm_up(ckpts.values())
        runs = train_rounds(state, ckpts, args.steps, args.every, args.repeats)
        setup = setups(ckpts)

    notes = [f"tierstate: host cache {cache / GiB:.2f} GiB, sized to hold the whole state ({fmt_bytes(nbytes)}), so "
             "capture never waits for persist; blocked = handle.blocked_s (the call + the optimizer pre-hook's wait)"]
    if not CUDA:
        notes.append("no CUDA: DCP's pinned memory / non-blocking copies do not exist here, so DCP stages into "
                     "plain memory; tierstate's host cache is not pinned either")
    report = blocked_report(
        "blocked",
        f"Blocked time per checkpoint in a {args.model.upper()} training loop: {state.n_params / 1e6:.1f} M params, "
        f"state {fmt_bytes(nbytes)}, checkpoint every {args.every} steps, {args.steps} steps x {args.repeats} rounds",
        runs,
        "dcp.async_save",
        args.every,
        setup,
        tuple(notes),
    )
    report.raw.update({"state_bytes": nbytes, "n_params": state.n_params, "cache_bytes": cache, "setups": setup,
                       "args": vars(args)})
    publish("blocked", [report], facts, argv, args.results_dir, args.tag)
    return 0


if __name__ == "__main__":
    sys.exit(main())
