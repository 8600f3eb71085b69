"""The configs that ship with tierstate, by name: the one list every message and the CLI use.

Installed, they are package data in tierstate/configs beside tierstate/pipeline; in a checkout,
configs/ sits beside pipeline/: the same place relative to this file (resolved, because a
development checkout may reach pipeline/ through a symlink). Nothing here imports more than
pathlib, so the CLI's ``--help`` can name them without loading the config machinery.
"""

from __future__ import annotations

from pathlib import Path

PACKAGED_DIR = Path(__file__).resolve().parent.parent / "configs"
DEFAULT_NAME = "default"


def packaged_configs() -> list[str]:
    """The names of the configs that ship with tierstate (``cluster``, ``compressed``, ``default``, ...)."""
    return sorted(path.stem for path in PACKAGED_DIR.glob("*.yaml"))


def packaged_config(name: str) -> Path:
    """The file of the packaged config ``name`` (``tiered`` or ``tiered.yaml``), which may not exist."""
    return PACKAGED_DIR / f"{name.removesuffix('.yaml')}.yaml"
