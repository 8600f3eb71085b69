"""Which tiers a ``tierstate`` command works on, with their policies, and its other option values.

Tiers come from a pipeline YAML (``--config``: its ``tiers`` section, policies included) and/or
from ``--tier NAME=PATH`` options (no policies). The tiers package must not import pipeline, so
the YAML is read here only for its ``tiers`` section, validated with the same policy models the
pipeline config uses. Every bad value is a :class:`UsageError` that names the option or key.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import yaml
from pydantic import ByteSize, TypeAdapter, ValidationError

from tierstate.errors import TierstateError

from .filesystem import FilesystemTier
from .policy import FlushPolicy, RetentionPolicy
from .retention import TierPolicies

_DURATION_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([smhd]?)\s*$")
_SECONDS = {"": 1, "s": 1, "m": 60, "h": 3600, "d": 86400}


class UsageError(TierstateError):
    """Bad command-line input: printed without a traceback, exit code 2."""


def _policy(model: type[RetentionPolicy | FlushPolicy], raw: Any, where: str) -> Any:
    try:
        return model.model_validate(raw)
    except ValidationError as exc:
        first = exc.errors(include_url=False)[0]
        key = ".".join(str(part) for part in first["loc"])
        raise UsageError(f"{where}{'.' + key if key else ''}: {first['msg']}") from None


def _from_yaml(path: str) -> list[TierPolicies]:
    try:
        doc = yaml.safe_load(Path(path).read_text())
    except (OSError, yaml.YAMLError) as exc:
        raise UsageError(f"{path}: cannot read config: {exc}") from None
    tiers = doc.get("tiers") if isinstance(doc, dict) else None
    if not isinstance(tiers, dict) or not tiers:
        raise UsageError(f"{path}: tiers: no tiers defined")
    found = []
    for name, spec in tiers.items():
        where = f"{path}: tiers.{name}"
        if not isinstance(spec, dict) or not isinstance(spec.get("path"), str):
            raise UsageError(f"{where}.path: expected a directory path")
        flush = spec.get("flush")
        found.append(
            TierPolicies(
                FilesystemTier(str(name), Path(spec["path"]).expanduser().resolve()),
                _policy(RetentionPolicy, spec.get("retention") or {}, f"{where}.retention"),
                None if flush is None else _policy(FlushPolicy, flush, f"{where}.flush"),
            )
        )
    return found


def load_tiers(config: str | None, tier_options: Sequence[str] | None) -> list[TierPolicies]:
    """The tiers of ``--config`` (with policies) followed by those of ``--tier NAME=PATH``."""
    tiers = _from_yaml(config) if config else []
    for spec in tier_options or []:
        name, sep, path = spec.partition("=")
        if not sep or not name or not path:
            raise UsageError(f"--tier {spec!r}: expected NAME=PATH")
        tiers.append(TierPolicies(FilesystemTier(name, Path(path).expanduser().resolve())))
    if not tiers:
        raise UsageError("no tiers: give --config FILE or --tier NAME=PATH")
    names = [t.tier.name for t in tiers]
    repeated = sorted({n for n in names if names.count(n) > 1})
    if repeated:
        raise UsageError(f"tier {repeated[0]!r} is given twice")
    return tiers


def pick(tiers: Sequence[TierPolicies], name: str, option: str) -> TierPolicies:
    """The tier called ``name``; the error names the option and the tiers there are."""
    for policies in tiers:
        if policies.tier.name == name:
            return policies
    known = ", ".join(t.tier.name for t in tiers)
    raise UsageError(f"{option} {name}: no such tier (tiers: {known})")


def select(tiers: Sequence[TierPolicies], names: Sequence[str] | None, option: str) -> list[TierPolicies]:
    """The tiers named by a repeatable option, in tier order; all of them when it was not given."""
    if not names:
        return list(tiers)
    chosen = {pick(tiers, name, option).tier.name for name in names}
    return [t for t in tiers if t.tier.name in chosen]


def parse_duration(text: str, option: str) -> float:
    """Seconds from ``90``, ``30s``, ``10m``, ``2h`` or ``1d``."""
    match = _DURATION_RE.match(text)
    if match is None:
        raise UsageError(f"{option} {text!r}: expected a duration such as 90, 30s, 10m, 2h or 1d")
    return float(match.group(1)) * _SECONDS[match.group(2)]


def parse_size(text: str, option: str) -> int:
    """Bytes from ``200MB``, ``1GiB`` or a plain number."""
    try:
        size = int(TypeAdapter(ByteSize).validate_python(text))
    except ValidationError:
        raise UsageError(f"{option} {text!r}: expected a size such as 200MB, 1GiB or a number of bytes") from None
    if size <= 0:
        raise UsageError(f"{option} {text!r}: must be more than 0 bytes")
    return size
