"""Many small tensors: blocked time, time to durable and restore for 10^2 .. 10^5 tensors of 16 float32,
tierstate against torch.save (+fsync) and torch.load (+ copy into the live tensors), in one run.

The state is a ``{name: tensor}`` dict (the library's ``TensorDictProvider``: its tensors are copied
before ``checkpoint()`` returns), the shape of a large or mixture-of-experts model's optimizer state
per rank. For each count both methods save and restore the same state, interleaved over ``--repeats``
rounds after one untimed warm-up each; medians are reported, with the same-run ratios.

    python benchmarks/many_tensors.py                                  # 10^2 .. 10^5, ~5 min
    python benchmarks/many_tensors.py --counts 100,1000 --repeats 1    # smoke test
"""

from __future__ import annotations

import gc
import sys
import time
from typing import Any

from harness.cli import parser
from harness.dict_state import synthetic_state
from harness.machine import start_run
from harness.methods import closing_all, make_checkpointers
from harness.paths import bench_root
from harness.report import Report, progress, publish
from harness.stats import interleave, median
from harness.tierstate_checkpointer import cache_for
from harness.timing import time_save, warm_up
from harness.units import fmt_ratio, fmt_s

METHODS = ["tierstate", "torch.save"]
ELEMENTS = 16  # float32 per tensor: 64 bytes


def run_count(count: int, root: Any, repeats: int) -> dict[str, dict[str, list[float]]]:
    """Per method: the blocked, durable and restore seconds of every round."""
    state = synthetic_state(count * ELEMENTS * 4, ELEMENTS * 4)
    times: dict[str, dict[str, list[float]]] = {m: {"blocked": [], "durable": [], "restore": []} for m in METHODS}
    cache = cache_for(state.tensor_bytes)
    with closing_all(make_checkpointers(METHODS, state, root, cache_bytes=cache)) as ckpts:
        warm_up(ckpts.values())
        for repeat, name in interleave(METHODS, repeats):
            ckpt = ckpts[name]
            ckpt.clear()
            step = repeat + 1
            timing = time_save(ckpt, step)  # no optimizer: nothing waits before a next step, the call is all
            started = time.perf_counter()
            ckpt.restore(step)
            times[name]["restore"].append(time.perf_counter() - started)
            times[name]["blocked"].append(timing.call_s)
            times[name]["durable"].append(timing.durable_s)
    del state, ckpts
    gc.collect()
    return times


def report_from(raw: dict[str, Any], repeats: int) -> Report:
    table = Report(
        "many-tensors",
        f"{ELEMENTS} float32 per tensor, TensorDictProvider: median of {repeats} rounds",
        ["tensors", "tierstate blocked", "durable", "restore", "torch.save (+fsync)", "torch.load + copy",
         "torch.save÷durable", "torch.load÷restore"],
    )
    for count, times in raw.items():
        med = {m: {k: median(v) for k, v in t.items()} for m, t in times.items()}
        mine, theirs = med["tierstate"], med["torch.save"]
        table.add(count, fmt_s(mine["blocked"]), fmt_s(mine["durable"]), fmt_s(mine["restore"]),
                  fmt_s(theirs["durable"]), fmt_s(theirs["restore"]),
                  fmt_ratio(theirs["durable"] / mine["durable"]), fmt_ratio(theirs["restore"] / mine["restore"]))
    table.note("blocked: tierstate's checkpoint() call (describe and plan, or the reused plan, and the copy of "
               "every tensor, since a TensorDictProvider's tensors may change at any time; no optimizer, so no "
               "wait before a step); torch.save blocks for its whole save, its durable time")
    table.note("durable: request -> fsync'd and committed; restore: into the live tensors, from the page cache "
               "(both methods read what they just wrote), tierstate verifying every frame's checksum")
    table.note("ratios > 1: tierstate is faster")
    table.raw = {"times": raw}
    return table


def main(argv: list[str] | None = None) -> int:
    cli = parser("many_tensors", __doc__, repeats=3)
    cli.add_argument("--counts", default="100,1000,10000,100000", help="comma-separated tensor counts")
    args = cli.parse_args(argv)
    facts = start_run()
    raw: dict[int, Any] = {}
    with bench_root("many-tensors") as root:
        for count in (int(c) for c in args.counts.split(",")):
            raw[count] = run_count(count, root, args.repeats)
            progress(f"{count} tensors: " + ", ".join(
                f"{m} " + "/".join(f"{median(v):.4f}" for v in t.values()) for m, t in raw[count].items()))
    table = report_from(raw, args.repeats)
    table.raw["args"] = vars(args)
    publish("many_tensors", [table], facts, argv, args.results_dir)
    return 0


if __name__ == "__main__":
    sys.exit(main())
