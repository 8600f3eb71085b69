"""Declarative pipeline spec: YAML -> validated, immutable :class:`PipelineConfig`.

The YAML file is the only place a user says how checkpoints move (chunking, host cache, tiers,
the stage chain), so a mistake in it must fail before training starts, and say exactly where:
every problem is reported as ``<source>: <dotted.key.path>: <message>``, all at once, so one
edit-run cycle fixes them all. The runner and the ``tierstate`` CLI both read configs here.

Validation happens in two passes. Pydantic checks the schema (pipeline/config_schema.py: types,
ranges, unknown keys) and collects every error. Only a schema-valid config reaches the checks
across sections (pipeline/config_checks.py: stage graph, tier references, cache size), because
those need well-typed values to reason about. Strict YAML reading and the wording of every error
are in pipeline/config_errors.py, the packaged configs in pipeline/packaged.py. This module loads.
"""

from __future__ import annotations

import copy
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from pydantic import ValidationError, model_validator

from tierstate.suggest import closest

from .config_checks import semantic_problems
from .config_errors import ConfigError, SemanticErrors, read_yaml, render, yaml_type
from .config_schema import TIERS, ConfigSchema, TierConfig
from .packaged import DEFAULT_NAME, packaged_config, packaged_configs

__all__ = ["ConfigError", "PipelineConfig", "config_path", "load_config", "parse_config", "parse_tiers"]


class PipelineConfig(ConfigSchema):
    """The whole validated spec: the schema, and the checks across its sections passed; a valid
    instance always has a well-formed stage chain."""

    @model_validator(mode="after")
    def _semantics(self) -> PipelineConfig:
        problems = semantic_problems(self)
        if problems:
            raise SemanticErrors(problems)
        return self


def config_path(name_or_path: str | os.PathLike[str] | None = None) -> Path:
    """The file a config argument means: None is the packaged default; a file that exists is itself;
    a bare name (``tiered`` or ``tiered.yaml``, no directory) that is not a file here is the packaged
    config of that name. Anything else is returned as given, for the reader to report missing."""
    if name_or_path is None:
        return packaged_config(DEFAULT_NAME)
    path = Path(name_or_path)
    if path.is_file() or not isinstance(name_or_path, str) or path.name != name_or_path:
        return path
    packaged = packaged_config(name_or_path)
    return packaged if packaged.is_file() else path


def load_config(
    name_or_path: str | os.PathLike[str] | None = None, overrides: Mapping[str, Any] | None = None
) -> PipelineConfig:
    """Read and validate a YAML config: a file, or a packaged config by name (see :func:`config_path`;
    None = the packaged default, tiers under ./checkpoints). ``overrides`` as in :func:`parse_config`."""
    path = config_path(name_or_path)
    source = os.fspath(path)
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        packaged = packaged_configs()
        # A bare name is a packaged config's: a mistyped one (``tierd``) is guessed at.
        meant = closest(source.removesuffix(".yaml"), packaged) if source == path.name else None
        guess = f"; did you mean the packaged config {meant!r}?" if meant else ""
        hint = f"packaged configs, by name: {', '.join(packaged)}; `tierstate init` writes an editable copy"
        raise ConfigError(source, [f"file not found{guess} ({hint})"]) from None
    except OSError as exc:
        raise ConfigError(source, [f"cannot read: {exc.strerror or exc}"]) from None
    return parse_config(text, source=source, overrides=overrides)


def parse_config(
    data: Mapping[str, Any] | str,
    source: str = "<config>",
    overrides: Mapping[str, Any] | None = None,
) -> PipelineConfig:
    """Validate a config given as YAML text or an already-parsed mapping.

    ``overrides`` maps dotted key paths to values, applied to the raw data before validation so
    they are checked like the file itself: ``{"tiers.nvme.path": tmp, "host_cache.size": "4MiB"}``.
    A value replaces what is there wholesale, so ``{"tiers": {...}}`` swaps all tiers at once.
    """
    raw = read_yaml(data, source) if isinstance(data, str) else data
    if not isinstance(raw, Mapping):
        name = yaml_type(raw)
        given = "an empty document" if raw is None else f"{'an' if name[0] in 'aeiou' else 'a'} {name}"
        raise ConfigError(source, [f"<top level>: expected a mapping of settings (version, tiers, ...), got {given}"])
    raw = _apply_overrides(raw, overrides or {}, source)
    try:
        return PipelineConfig.model_validate(raw)
    except ValidationError as exc:
        raise ConfigError(source, render(exc, PipelineConfig, overrides=overrides)) from None


def parse_tiers(data: Mapping[str, Any], source: str) -> dict[str, TierConfig]:
    """Validate a ``tiers`` section on its own, by the rules :class:`PipelineConfig` applies to it
    (names, paths resolved the same way, policies): for tiers given without a config file."""
    try:
        return TIERS.validate_python(data)
    except ValidationError as exc:
        raise ConfigError(source, render(exc, PipelineConfig, at=("tiers",))) from None


def _apply_overrides(raw: Mapping[str, Any], overrides: Mapping[str, Any], source: str) -> dict[str, Any]:
    """A deep copy of ``raw`` with dotted-key overrides set, creating missing mappings on the way."""
    result = copy.deepcopy(dict(raw))
    for dotted, value in overrides.items():
        *parents, leaf = dotted.split(".")
        if not leaf or not all(parents):
            raise ConfigError(source, [f"{dotted!r}: invalid override key"])
        node = result
        for depth, part in enumerate(parents, start=1):
            child = node.setdefault(part, {})
            if not isinstance(child, dict):
                prefix = ".".join(parents[:depth])
                problem = f"cannot apply override {dotted!r}: {prefix} is a {yaml_type(child)}, not a mapping"
                raise ConfigError(source, [f"{prefix}: {problem}"])
            node = child
        node[leaf] = copy.deepcopy(value)
    return result
