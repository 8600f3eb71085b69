"""The repository's folders the benchmarks read from and write to."""

from __future__ import annotations

import contextlib
import shutil
from collections.abc import Iterator
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
DEFAULT_YAML = REPO_ROOT / "configs" / "default.yaml"
RESULTS_DIR = REPO_ROOT / "benchmarks" / "results"
BENCH_ROOT = REPO_ROOT / "checkpoints"  # git-ignored scratch space for the checkpoints being timed


def fresh_dir(path: Path) -> Path:
    """``path`` as a new empty folder: nothing a previous run left there can be read as this run's."""
    shutil.rmtree(path, ignore_errors=True)
    path.mkdir(parents=True)
    return path


@contextlib.contextmanager
def bench_root(name: str, keep: bool = False) -> Iterator[Path]:
    """``./checkpoints/bench-<name>/``, removed afterwards unless ``keep``."""
    root = fresh_dir(BENCH_ROOT / f"bench-{name}")
    try:
        yield root
    finally:
        if not keep:
            shutil.rmtree(root, ignore_errors=True)
