"""The collector pause around metadata work: nestable across threads, and it restores what it found."""

from __future__ import annotations

import gc
import threading
from pathlib import Path

import torch

from tierstate.providers import TensorDictProvider
from tierstate.tiers.format.gcpause import gc_paused
from tierstate.tiers.reading.stored import load


def test_pauses_nest_across_threads_and_the_last_one_out_resumes() -> None:
    assert gc.isenabled()
    inside, release = threading.Event(), threading.Event()

    def other() -> None:
        with gc_paused():
            inside.set()
            release.wait()

    thread = threading.Thread(target=other, daemon=True)
    try:
        with gc_paused():
            thread.start()
            inside.wait()
            assert not gc.isenabled()
        assert not gc.isenabled()  # the other thread still holds its pause
    finally:
        release.set()
        thread.join()
    assert gc.isenabled()


def test_a_collector_the_user_disabled_stays_disabled() -> None:
    gc.disable()
    try:
        with gc_paused():
            pass
        assert not gc.isenabled()
    finally:
        gc.enable()


def test_reading_a_checkpoint_runs_no_cyclic_collection(make_runner, tmp_path: Path) -> None:
    """10^4 items are ~10^5 objects: without the pause the collector would run hundreds of times."""
    tensors = {f"t{i}": torch.full((4,), float(i)) for i in range(10_000)}
    runner = make_runner()
    runner.register(t=TensorDictProvider(tensors))
    path = runner.checkpoint(1).result().path
    collections: list[int] = []

    def count(phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            collections.append(info["generation"])

    gc.collect()
    gc.callbacks.append(count)
    try:
        state = load(path)
        during = len(collections)
    finally:
        gc.callbacks.remove(count)
    assert torch.equal(state["t/t9999"], tensors["t9999"])
    assert during <= 1  # at most the one the young objects trigger once the pause ends
