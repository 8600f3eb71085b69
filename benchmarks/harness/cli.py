"""The arguments every benchmark script shares, so each script declares only its own."""

from __future__ import annotations

import argparse
from pathlib import Path

from .gpt_state import GPT_PRESETS
from .paths import RESULTS_DIR


def parser(
    script: str,
    doc: str,
    *,
    preset: str | None = None,
    repeats: int | None = None,
    methods: list[str] | None = None,
    tag: bool = False,
) -> argparse.ArgumentParser:
    """The parser of ``benchmarks/<script>.py``, described by the first paragraph of its docstring
    ``doc``: ``--results-dir`` always; ``--preset``, ``--repeats``, ``--methods`` (comma-separated, as
    given: split it with ``args.methods.split(",")``) with these defaults where given; ``--tag`` if
    ``tag``."""
    p = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    p.add_argument("--results-dir", type=Path, help=f"where the .json and .md of the run go (default {RESULTS_DIR})")
    if preset is not None:
        p.add_argument("--preset", default=preset, choices=list(GPT_PRESETS), help="GPT size")
    if repeats is not None:
        p.add_argument("--repeats", type=int, default=repeats, help="interleaved rounds")
    if methods is not None:
        p.add_argument("--methods", default=",".join(methods), help="comma-separated, of: " + ",".join(methods))
    if tag:
        p.add_argument("--tag", default="", help=f"results go to {script}-<tag>.json instead of {script}.json")
    return p
