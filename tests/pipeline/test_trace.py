"""A checkpoint's timeline as a Chrome/Perfetto trace, and its stage work in a torch profile."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import torch

from tierstate import Runner
from tierstate.cli import main

SLOW = {"host_cache__size": "4MiB", "chunk_size": "1MiB", "pipeline__stages__persist__bandwidth": "40MB"}


def _model_and_step() -> tuple[torch.nn.Module, torch.optim.Optimizer, Callable[[], None]]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(512, 512) for _ in range(4)])
    opt = torch.optim.AdamW(model.parameters())

    def step() -> None:
        model(torch.randn(4, 512)).sum().backward()
        opt.step()
        opt.zero_grad()

    step()
    return model, opt, step


def test_the_trace_has_every_stage_the_waits_and_the_trainers_blocked_time(
    make_runner: Callable[..., Runner], tmp_path: Path
) -> None:
    model, opt, step = _model_and_step()
    runner = make_runner(**SLOW)
    runner.register(model=model, optim=opt)
    runner.checkpoint(1).result()
    step()
    handle = runner.checkpoint(2)  # with the plan made by the first
    step()  # the pre-hook waits for the capture, which waits for slabs that a paced persist frees
    result = handle.result()
    assert handle.stats.blocked_s > 0.05
    out = tmp_path / "trace.json"
    assert main(["stats", str(result.path), "--trace", str(out)]) == 0
    trace = json.loads(out.read_text())
    events = [e for e in trace["traceEvents"] if e["ph"] != "M"]
    threads = {e["tid"]: e["args"]["name"] for e in trace["traceEvents"] if e["name"] == "thread_name"}
    names = {e["name"] for e in events}
    for stage in ("capture", "serialize", "compress", "persist"):
        assert any(name.split(" ")[0] == stage for name in names), (stage, names)
    assert {"wait: host-cache slab", "trainer blocked: checkpoint()", "trainer blocked: waiting for capture"} <= names
    blocked = [e for e in events if e["name"].startswith("trainer blocked")]
    assert {threads[e["tid"]] for e in blocked} == {"MainThread"}  # the trainer's own track
    work = [e for e in events if e["ph"] == "X" and e["name"] in ("capture", "persist")]
    assert all(e["dur"] > 0 and e["ts"] >= 0 for e in work)
    assert "MainThread" not in {threads[e["tid"]] for e in work}  # on the pipeline's threads
    persisted = sum(e["args"]["bytes"] for e in work if e["name"] == "persist")
    assert persisted >= result.raw_bytes  # every byte it wrote (data and objects) is on the timeline


def test_the_trainers_time_in_tierstate_shows_in_a_torch_profile(make_runner: Callable[..., Runner]) -> None:
    """Beside the training step in a torch profile of the trainer's thread: the checkpoint() call and the
    optimizer pre-hook's wait for the capture."""
    model, opt, step = _model_and_step()
    runner = make_runner(**SLOW)
    runner.register(model=model, optim=opt)
    runner.checkpoint(1).result()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profile:
        step()
        handle = runner.checkpoint(2)
        step()
        handle.result()
    recorded = {event.key for event in profile.key_averages()}
    assert {"tierstate/checkpoint()", "tierstate/waiting for capture"} <= recorded, sorted(recorded)[:20]
    assert "Optimizer.step#AdamW.step" in recorded  # the step it sits beside
