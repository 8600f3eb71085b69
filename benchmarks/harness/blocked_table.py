"""The blocked-time table of a training loop with checkpoints (``blocked.py`` on the CPU, ``gpu.py``)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from .copy_floor import CopyFloorCheckpointer
from .report import Report
from .stats import median
from .units import fmt_ratio, fmt_s


def _slowdown_note(every: int) -> str:
    return ("slowdown (run) = loop wall time / the `none` run of the same round - 1, median over rounds (a run has "
            "no checkpoint in its last interval); slowdown (steady) = extra seconds per checkpoint within the run "
            "(its steps' sum - steps x its median step, minus the median of the same over the `none` runs) / "
            f"({every} x that median step): a long run checkpointing every {every} steps; 'durable after' = from "
            "the request to committed on disk; one untimed warm-up checkpoint per method first")


def _excess(run: dict[str, Any]) -> float:
    """Seconds above the run's own median step."""
    return sum(run["step_s"]) - len(run["step_s"]) * median(run["step_s"])


def blocked_report(
    name: str,
    title: str,
    runs: Mapping[str, list[dict[str, Any]]],
    async_baseline: str,
    every: int,
    setups: Mapping[str, str],
    notes: tuple[str, ...] = (),
) -> Report:
    """The blocked-time table: per method, blocked seconds per checkpoint and the slowdown vs ``none``.

    Two slowdowns: ``run`` is the loop's wall time over the ``none`` run of the same round (a run has
    no checkpoint in its last interval, so it holds fewer than one per ``every`` steps); ``steady`` is
    what a long run with a checkpoint every ``every`` steps loses: the extra seconds per checkpoint,
    taken within the run (sum of its steps - steps x its median step, so drift of the shared machine
    between runs cancels; minus the median of the same excess over the ``none`` runs, which the skew
    of step times gives even without checkpoints), over ``every`` median steps. Notes: ``notes``,
    each method's setup, then how the slowdowns are computed.
    """
    report = Report(name, title, ["method", "blocked/ckpt", "max", "torch.save÷this", f"{async_baseline}÷this",
                                  "step", "slowdown (run)", f"slowdown (steady, every {every})", "durable after"])

    def blocked_of(method: str) -> list[float]:
        return [b for r in runs.get(method, []) for b in r["blocked_s"]]

    base_save, base_async = median(blocked_of("torch.save")), median(blocked_of(async_baseline))
    baseline = runs.get("none")
    # Steps are skewed (an occasional slow one), so a run without checkpoints has some excess too: the
    # median excess of the `none` runs is subtracted (one round's own `none` run, as before, let one
    # stray 2.5 s step there turn that round's checkpoints into a negative cost).
    skew = median(_excess(n) for n in baseline) if baseline else 0.0
    for method, method_runs in runs.items():
        blocked = blocked_of(method)
        b = median(blocked)
        compared = bool(blocked) and method != CopyFloorCheckpointer.name  # the floor saves nothing: no ratio
        slowdowns, steady = [], []
        if baseline and method != "none":
            slowdowns = [r["loop_s"] / n["loop_s"] - 1 for r, n in zip(method_runs, baseline, strict=True)]
        for r in method_runs if method != "none" else []:
            if r["blocked_s"]:
                per_checkpoint = (_excess(r) - skew) / len(r["blocked_s"])
                steady.append(per_checkpoint / (every * median(r["step_s"])))
        report.add(
            method,
            fmt_s(b) if blocked else "-",
            fmt_s(max(blocked)) if blocked else "-",
            fmt_ratio(base_save / b) if compared else "-",
            fmt_ratio(base_async / b) if compared else "-",
            fmt_s(median(s for r in method_runs for s in r["step_s"])),
            f"{median(slowdowns) * 100:+.1f}%" if slowdowns else "-",
            f"{median(steady) * 100:+.1f}%" if steady else "-",
            fmt_s(median(d for r in method_runs for d in r["durable_s"])) if blocked else "-",
        )
        report.raw[method] = {"runs": method_runs, "slowdowns": slowdowns, "steady_slowdowns": steady}
    for text in notes:
        report.note(text)
    report.note_each(setups)
    report.note(_slowdown_note(every))
    return report
