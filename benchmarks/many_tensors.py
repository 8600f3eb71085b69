"""Many small tensors: blocked time, time to durable and restore for 10^2 .. 10^5 tensors of 16 float32,
tierstate against torch.save (+fsync) / torch.load (+ copy into the live tensors) and PyTorch DCP
(``save``, ``async_save``'s blocked time, ``load`` in place), in one run.

The state (``--state``) is either a ``{name: tensor}`` dict (``dict``: the library's ``TensorDictProvider``,
whose tensors are copied before ``checkpoint()`` returns), or a model of n/4 parameters and its Adam
after one step (``model``: registered as they are, so every tensor is captured lazily and what the
trainer waits for is listing the state and reusing the plan), the shape of a large or mixture-of-experts
model's optimizer state per rank. For each count both methods save and restore the same state,
interleaved over ``--repeats`` rounds after one untimed warm-up each; medians are reported, with the
same-run ratios.

    python benchmarks/many_tensors.py                                  # 10^2 .. 10^5, ~15 min
    python benchmarks/many_tensors.py --counts 100,1000 --repeats 1    # smoke test
    python benchmarks/many_tensors.py --methods tierstate,torch.save   # without DCP (~5 min)
    python benchmarks/many_tensors.py --state model --counts 10000,100000 --methods tierstate,torch.save,dcp.async_save
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
from harness.param_state import ParamState
from harness.paths import bench_root
from harness.report import Report, progress, publish
from harness.stats import interleave, median
from harness.tierstate_checkpointer import cache_for
from harness.timing import time_save, warm_up
from harness.units import fmt_ratio, fmt_s

METHODS = ["tierstate", "torch.save", "dcp.save", "dcp.async_save"]
RESTORES = {"tierstate", "torch.save", "dcp.save"}  # async_save writes what dcp.save does: one load is enough
ELEMENTS = 16  # float32 per tensor: 64 bytes


def run_count(
    count: int, root: Any, repeats: int, methods: list[str], kind: str = "dict"
) -> dict[str, dict[str, list[float]]]:
    """Per method: the blocked, durable and restore seconds of every round."""
    state = synthetic_state(count * ELEMENTS * 4, ELEMENTS * 4) if kind == "dict" else ParamState(count, ELEMENTS)
    times: dict[str, dict[str, list[float]]] = {
        m: {"blocked": [], "captured": [], "durable": [], "restore": [], "first": []} for m in methods
    }
    cache = cache_for(state.tensor_bytes)
    with closing_all(make_checkpointers(methods, state, root, cache_bytes=cache)) as ckpts:
        warm_up(ckpts.values())
        for repeat, name in interleave(methods, repeats):
            ckpt = ckpts[name]
            ckpt.clear()
            step = repeat + 1
            if isinstance(state, ParamState) and name == "tierstate":
                # The state holds the tensors the last restore (any method's) gave the optimizer: the first
                # checkpoint plans afresh, as the first one of a training run does; the timed one reuses it.
                times[name]["first"].append(time_save(ckpt, step + 1000).call_s)
                state.train_step()  # the timed one comes right after a step, as in training (cold CPU caches)
            timing = time_save(ckpt, step)  # no optimizer: nothing waits before a next step, the call is all
            if name in RESTORES:
                started = time.perf_counter()
                ckpt.restore(step)
                times[name]["restore"].append(time.perf_counter() - started)
            times[name]["blocked"].append(timing.call_s)
            times[name]["captured"].append(timing.staged_s)
            times[name]["durable"].append(timing.durable_s)
    del state, ckpts
    gc.collect()
    return times


def report_from(raw: dict[str, Any], repeats: int, kind: str = "dict") -> Report:
    shape = "TensorDictProvider" if kind == "dict" else "a ParameterList of n/4 parameters and its Adam, registered"
    table = Report(
        "many-tensors" if kind == "dict" else "many-tensors-model",
        f"{ELEMENTS} float32 per tensor, {shape}: median of {repeats} rounds",
        ["tensors", "tierstate blocked", *(["first after a restore"] if kind == "model" else []),
         "captured", "durable", "restore", "torch.save (+fsync)", "torch.load + copy",
         "torch.save÷durable", "torch.load÷restore", "dcp.async_save blocked", "dcp.save", "dcp.load",
         "dcp.save÷durable", "dcp.load÷restore"],
    )
    for count, times in raw.items():
        med = {m: {k: median(v) if v else float("nan") for k, v in t.items()} for m, t in times.items()}
        nan = dict.fromkeys(("blocked", "captured", "durable", "restore", "first"), float("nan"))
        mine, theirs = med["tierstate"], med.get("torch.save", nan)
        dcp, dcp_async = med.get("dcp.save", nan), med.get("dcp.async_save", nan)
        first = [fmt_s(mine["first"])] if kind == "model" else []
        table.add(count, fmt_s(mine["blocked"]), *first, fmt_s(mine["captured"]), fmt_s(mine["durable"]),
                  fmt_s(mine["restore"]),
                  fmt_s(theirs["durable"]), fmt_s(theirs["restore"]),
                  fmt_ratio(theirs["durable"] / mine["durable"]), fmt_ratio(theirs["restore"] / mine["restore"]),
                  fmt_s(dcp_async["blocked"]), fmt_s(dcp["durable"]), fmt_s(dcp["restore"]),
                  fmt_ratio(dcp["durable"] / mine["durable"]), fmt_ratio(dcp["restore"] / mine["restore"]))
    if kind == "dict":
        table.note("blocked: tierstate's checkpoint() call (describe and plan, or the reused plan, and the copy of "
                   "every tensor, since a TensorDictProvider's tensors may change at any time; no optimizer, so no "
                   "wait before a step); torch.save blocks for its whole save, its durable time")
    else:
        table.note("blocked: tierstate's checkpoint() call (listing the model's and optimizer's tensors and reusing "
                   "the plan; every tensor is captured lazily), the second of two, right after an optimizer step; "
                   "first after a restore: the first of them, which plans afresh (the restore before it gave the "
                   "optimizer new tensors); "
                   "captured: request -> every tensor copied, the longest a next optimizer.step() could wait; "
                   "torch.save blocks for its whole save")
    table.note("durable: request -> fsync'd and committed; restore: into the live tensors, from the page cache "
               "(both methods read what they just wrote), tierstate verifying every frame's checksum")
    table.note("dcp.async_save blocked: its call (the default stager's synchronous copy of the state); dcp.load: "
               "in place into the live tensors (no checksums); ratios > 1: tierstate is faster")
    table.raw = {"times": raw}
    return table


def main(argv: list[str] | None = None) -> int:
    cli = parser("many_tensors", __doc__, repeats=3, methods=METHODS, tag=True)
    cli.add_argument("--counts", default="100,1000,10000,100000", help="comma-separated tensor counts")
    cli.add_argument(
        "--state", choices=["dict", "model"], default="dict", help="a tensor dict, or a model and its Adam"
    )
    args = cli.parse_args(argv)
    methods = args.methods.split(",")
    if "tierstate" not in methods:
        cli.error("--methods must include tierstate (the table is relative to it)")
    facts = start_run()
    raw: dict[int, Any] = {}
    with bench_root("many-tensors") as root:
        for count in (int(c) for c in args.counts.split(",")):
            raw[count] = run_count(count, root, args.repeats, methods, args.state)
            progress(f"{count} tensors: " + ", ".join(
                f"{m} " + "/".join(f"{median(v):.4f}" for v in t.values() if v) for m, t in raw[count].items()))
    table = report_from(raw, args.repeats, args.state)
    table.raw["args"] = vars(args)
    publish("many_tensors", [table], facts, argv, args.results_dir, args.tag)
    return 0


if __name__ == "__main__":
    sys.exit(main())
