"""Declarative pipeline spec: YAML -> validated, immutable :class:`PipelineConfig`.

The YAML file is the only place a user says how checkpoints move (chunking, host cache, tiers,
the stage chain), so a mistake in it must fail before training starts, and say exactly where:
every problem is reported as ``<source>: <dotted.key.path>: <message>``, all at once, so one
edit-run cycle fixes them all.

Validation happens in two passes. Pydantic checks the schema (types, ranges, unknown keys) and
collects every error. Only a schema-valid config reaches the semantic pass (stage graph, tier
references, cache size), because those checks need well-typed values to reason about.
"""

from __future__ import annotations

import copy
import difflib
import os
import types
import typing
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Annotated, Any, Literal, Union

import yaml
from pydantic import (
    AfterValidator,
    BaseModel,
    ByteSize,
    ConfigDict,
    Field,
    StrictBool,
    StrictInt,
    StringConstraints,
    ValidationError,
    field_validator,
    model_validator,
)

from tierstate.errors import TierstateError

from ..tiers.policy import FlushPolicy, RetentionPolicy

__all__ = [
    "STAGE_KINDS",
    "CaptureStage",
    "CompressStage",
    "ConfigError",
    "HostCacheConfig",
    "PersistStage",
    "PipelineConfig",
    "PipelineSpec",
    "PoliciesConfig",
    "SerializeStage",
    "StageBase",
    "StageConfig",
    "TierConfig",
    "load_config",
    "parse_config",
]

MiB = 1 << 20

StageKind = Literal["capture", "serialize", "compress", "persist"]
STAGE_KINDS: tuple[str, ...] = typing.get_args(StageKind)

# Which kind may follow which. Encoding the order as successor sets makes one edge check cover
# "wrong order", "each kind at most once" and "serialize is required"; "persist is required"
# follows from the rule that only persist may end the chain.
_SUCCESSORS: dict[str, frozenset[str]] = {
    "capture": frozenset({"serialize"}),
    "serialize": frozenset({"compress", "persist"}),
    "compress": frozenset({"persist"}),
    "persist": frozenset(),
}


class ConfigError(TierstateError, ValueError):
    """An invalid pipeline config; ``problems`` holds one ``key.path: message`` per problem.

    A ValueError so callers that treat bad input generically still catch it; ``source`` names the
    file (or ``<config>``) so the text is actionable when several configs are in play.
    """

    def __init__(self, source: str, problems: list[str]) -> None:
        self.source = source
        self.problems = problems
        super().__init__("\n".join(f"{source}: {problem}" for problem in problems))

    def __reduce__(self) -> tuple[type[ConfigError], tuple[str, list[str]]]:
        # The default reduce replays args=(message,), which does not match __init__; errors must
        # survive pickling to cross process boundaries (multiprocessing, torchrun workers).
        return (type(self), (self.source, self.problems))


class _SemanticErrors(ValueError):
    """Carries several ``(key.path, message)`` problems out of one pydantic model validator.

    A validator can raise only one error at the model root; pydantic keeps the original exception
    in the error's ``ctx``, so the formatter can unpack all problems with their own key paths.
    """

    def __init__(self, problems: list[tuple[str, str]]) -> None:
        self.problems = problems
        super().__init__("; ".join(f"{path}: {message}" for path, message in problems))


def _at_least(minimum: int) -> AfterValidator:
    """A size lower bound whose message is in human units (``1.0MiB``), not raw byte counts."""

    def check(value: ByteSize) -> ByteSize:
        if value < minimum:
            floor = ByteSize(minimum).human_readable()
            raise ValueError(f"must be at least {floor}, got {value.human_readable()}")
        return value

    return AfterValidator(check)


def _power_of_two_alignment(value: ByteSize) -> ByteSize:
    """Frames are aligned for O_DIRECT, which needs a power of two from the sector size (512) up."""
    if not 512 <= value <= MiB or value & (value - 1):
        raise ValueError(f"must be a power of two between 512 and 1048576 (1MiB), got {int(value)}")
    return value


class _Strict(BaseModel):
    """Base for every section: unknown keys are errors (typos must not be silently ignored), and a
    loaded config is immutable because runner threads share it."""

    model_config = ConfigDict(extra="forbid", frozen=True)


class HostCacheConfig(_Strict):
    """The fixed host buffer pool; allocated once so memory stays bounded and pinning is paid once."""

    size: ByteSize = ByteSize(256 * MiB)
    pinned: Literal["auto", True, False] = "auto"


class TierConfig(_Strict):
    """One durable filesystem tier (local NVMe, a parallel file system mount, any directory).

    ``retention`` says which checkpoints it keeps; ``flush`` makes it receive background copies of
    the checkpoints the persist tier commits (see tiers/policy.py, shared with the CLI).
    """

    path: Path
    retention: RetentionPolicy = RetentionPolicy()
    flush: FlushPolicy | None = None

    @field_validator("path", mode="before")
    @classmethod
    def _absolute(cls, value: Any) -> Any:
        # Resolved once at load time so a later os.chdir in the trainer cannot redirect writes.
        # An empty path would silently mean the working directory, so it is refused.
        if not isinstance(value, str | os.PathLike):
            return value  # pydantic reports the wrong type
        if not os.fspath(value).strip():
            raise ValueError("must not be empty")
        return os.path.abspath(os.path.expanduser(value))


class StageBase(_Strict):
    """Fields every stage has: its worker task count, the bound of its input queue, its successor."""

    kind: StageKind
    workers: Annotated[StrictInt, Field(ge=1)] = 1
    queue: Annotated[StrictInt, Field(ge=1)] = 4
    next: str | None = None


class CaptureStage(StageBase):
    """Copies device tensors into host-cache slabs (lazy: overlapped with forward/backward)."""

    kind: Literal["capture"] = "capture"


class SerializeStage(StageBase):
    """Lays items out as frames in chunks and serializes metadata and Python objects."""

    kind: Literal["serialize"] = "serialize"


class CompressStage(StageBase):
    """Optional compression of chunks; ``codec: none`` keeps the stage but passes bytes through."""

    kind: Literal["compress"] = "compress"
    codec: Literal["none", "zstd"] = "zstd"
    level: Annotated[StrictInt, Field(ge=-7, le=22)] = 1  # configs/compressed.yaml says why
    threads: Annotated[StrictInt, Field(ge=0)] = 0
    # Byte-shuffle by the chunk's element size before zstd (auto), or compress the bytes as they are (off).
    shuffle: Literal["auto", "off"] = "auto"


class PersistStage(StageBase):
    """Writes chunks to the first durable tier; ``bandwidth`` (bytes/s) throttles it, null = unlimited."""

    kind: Literal["persist"] = "persist"
    tier: str
    bandwidth: Annotated[ByteSize, _at_least(1)] | None = None
    # Transient write errors (ENOSPC, EIO, ...) of a frame or the index are retried this many times,
    # waiting `backoff` seconds before the first retry and doubling; fsync and commit are never retried.
    retries: Annotated[StrictInt, Field(ge=0, le=100)] = 0
    backoff: Annotated[float, Field(gt=0, le=600)] = 0.5
    # auto: raw slabs are written with O_DIRECT where the file system allows it (no page-cache copy);
    # buffered: always through the page cache (for file systems whose O_DIRECT path is slow).
    io: Literal["auto", "buffered"] = "auto"
    # frames: the tierstate data file; hdf5: an HDF5 file per rank, one dataset per tensor (tiers/hdf5.py).
    format: Literal["frames", "hdf5"] = "frames"


StageConfig = Annotated[
    CaptureStage | SerializeStage | CompressStage | PersistStage,
    Field(discriminator="kind"),
]


class PipelineSpec(_Strict):
    """The stage graph: named stages linked by ``next`` into one chain starting at capture."""

    stages: dict[str, StageConfig]

    @field_validator("stages", mode="before")
    @classmethod
    def _kind_from_name(cls, stages: Any) -> Any:
        # Lets the common case (a stage named after its kind) omit `kind` without giving up the
        # discriminated union, which is what yields per-kind errors at precise key paths.
        if not isinstance(stages, Mapping):
            return stages
        return {
            name: {**stage, "kind": name}
            if isinstance(stage, Mapping) and "kind" not in stage and name in STAGE_KINDS
            else stage
            for name, stage in stages.items()
        }


class PoliciesConfig(_Strict):
    """Behaviour choices that are not about moving bytes."""

    in_flight: Literal["wait", "skip"] = "wait"
    allow_pickle: StrictBool = False


TierName = Annotated[str, StringConstraints(pattern=r"^[a-z][a-z0-9_-]*$")]


class PipelineConfig(_Strict):
    """The whole validated spec; a valid instance always has a well-formed stage chain."""

    version: StrictInt = 1
    chunk_size: Annotated[ByteSize, _at_least(MiB)] = ByteSize(16 * MiB)
    align: Annotated[ByteSize, AfterValidator(_power_of_two_alignment)] = ByteSize(4096)
    host_cache: HostCacheConfig = HostCacheConfig()
    tiers: Annotated[dict[TierName, TierConfig], Field(min_length=1)]
    pipeline: PipelineSpec
    policies: PoliciesConfig = PoliciesConfig()

    @field_validator("version")
    @classmethod
    def _supported_version(cls, value: int) -> int:
        if value != 1:
            raise ValueError(f"unsupported version {value}; only version 1 is supported")
        return value

    @model_validator(mode="after")
    def _semantics(self) -> PipelineConfig:
        graph = list(_graph_problems(self.pipeline.stages))
        problems = list(graph)
        for name, stage in self.pipeline.stages.items():
            if isinstance(stage, PersistStage) and stage.tier not in self.tiers:
                problems.append((
                    f"pipeline.stages.{name}.tier",
                    f"tier {stage.tier!r} is not defined under tiers (defined: {', '.join(self.tiers)})",
                ))
        if not graph:  # these walk the chain, which a broken graph (a cycle, a dangling next) does not have
            problems += _tier_format_problems(self)
        if self.host_cache.size < 2 * self.chunk_size:
            chunk = self.chunk_size.human_readable()
            problems.append((
                "host_cache.size",
                (f"{self.host_cache.size.human_readable()} is smaller than 2 * chunk_size "
                 f"(2 * {chunk}); the cache must hold two chunks so capture can fill one "
                 "while another is being persisted"),
            ))
        if problems:
            raise _SemanticErrors(problems)
        return self

    def chain(self) -> list[tuple[str, StageConfig]]:
        """Stages in data-flow order, from capture to persist."""
        stages = self.pipeline.stages
        name: str | None = next(n for n, s in stages.items() if s.kind == "capture")
        ordered: list[tuple[str, StageConfig]] = []
        while name is not None:
            ordered.append((name, stages[name]))
            name = stages[name].next
        return ordered

    def stage_of_kind(self, kind: str) -> StageConfig | None:
        """The stage of ``kind`` (each kind occurs at most once), or None, e.g. without compress."""
        return next((stage for _, stage in self.chain() if stage.kind == kind), None)

    def durable_tiers(self) -> list[str]:
        """Tier names fastest first, as written in the YAML; all tiers are filesystem tiers."""
        return list(self.tiers)

    @property
    def persist_tier(self) -> str:
        """The tier the pipeline writes to; later tiers are reached by migration."""
        persist = self.stage_of_kind("persist")
        assert isinstance(persist, PersistStage)  # guaranteed by _semantics
        return persist.tier


def _tier_format_problems(config: PipelineConfig) -> list[tuple[str, str]]:
    """A flush into the tier being persisted to would copy a checkpoint onto itself; HDF5 datasets
    are stored raw, so they cannot take compressed chunks."""
    problems = []
    persist = config.stage_of_kind("persist")
    if persist is not None and persist.tier in config.tiers and config.tiers[persist.tier].flush is not None:
        problems.append((
            f"tiers.{persist.tier}.flush",
            f"the persist stage writes to {persist.tier!r}; flush copies from it to other tiers, so set flush there",
        ))
    compress = config.stage_of_kind("compress")
    if persist is not None and persist.format == "hdf5" and compress is not None and compress.codec != "none":
        name = next(n for n, s in config.pipeline.stages.items() if s is compress)
        problems.append((
            f"pipeline.stages.{name}.codec",
            "format hdf5 stores datasets uncompressed; set codec: none (or use format: frames)",
        ))
    return problems


def _graph_problems(stages: Mapping[str, StageBase]) -> Iterator[tuple[str, str]]:
    """Why ``stages`` is not one chain capture -> serialize -> (compress ->) persist."""
    captures = [name for name, stage in stages.items() if stage.kind == "capture"]
    if len(captures) != 1:
        found = f"{len(captures)} ({', '.join(captures)})" if captures else "none"
        yield "pipeline.stages", f"expected exactly one capture stage, found {found}"

    fed_by: dict[str, str] = {}
    for name, stage in stages.items():
        where = f"pipeline.stages.{name}.next"
        target = stage.next
        if target is None:
            if stage.kind != "persist":
                yield where, f"stage {name!r} feeds nothing: a {stage.kind} stage needs `next`"
        elif stage.kind == "persist":
            yield where, f"a persist stage ends the chain and cannot feed {target!r}; remove `next`"
        elif target not in stages:
            yield where, f"{target!r} is not a stage (stages: {', '.join(stages)})"
        else:
            if target in fed_by:
                yield where, (f"{target!r} is already fed by {fed_by[target]!r}; "
                              "stages must form a single chain")
            fed_by.setdefault(target, name)
            allowed = _SUCCESSORS[stage.kind]
            if stages[target].kind not in allowed:
                yield where, (f"{target!r} ({stages[target].kind}) cannot follow a {stage.kind} stage; "
                              f"expected {' or '.join(sorted(allowed))} "
                              "(order: capture -> serialize -> [compress ->] persist)")

    yield from _cycle_problems(stages, captures)
    if len(captures) == 1:
        reached = set(_walk(stages, captures[0]))
        for name in stages:
            if name not in reached:
                yield f"pipeline.stages.{name}", f"stage {name!r} is never fed: it is not on the chain from capture"


def _walk(stages: Mapping[str, StageBase], start: str) -> Iterator[str]:
    """Follow ``next`` from ``start``, stopping at a missing stage, the end, or a repeat."""
    visited: set[str] = set()
    name: str | None = start
    while name in stages and name not in visited:
        visited.add(name)
        yield name
        name = stages[name].next


def _cycle_problems(stages: Mapping[str, StageBase], captures: list[str]) -> Iterator[tuple[str, str]]:
    """Each cycle once, blamed on the ``next`` that closes it; walking from capture first roots
    the reported cycle where the user reads the chain from."""
    seen: set[str] = set()
    for start in [*captures, *stages]:
        if start in seen:
            continue
        path: list[str] = []
        for name in _walk(stages, start):
            if name in seen:
                break
            seen.add(name)
            path.append(name)
        else:
            closing = stages[path[-1]].next
            if closing in path:
                loop = path[path.index(closing):] + [closing]
                yield f"pipeline.stages.{path[-1]}.next", f"cycle {' -> '.join(loop)}"


# ---------------------------------------------------------------------------------------------
# Loading and error formatting
# ---------------------------------------------------------------------------------------------


class _UniqueKeyLoader(yaml.SafeLoader):
    """SafeLoader that rejects duplicate keys, which plain YAML resolves silently to the last one
    (two `compress:` stages would otherwise quietly become one)."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        seen: set[Any] = set()
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)
            if key in seen:
                raise yaml.constructor.ConstructorError(
                    "while constructing a mapping", node.start_mark, f"duplicate key {key!r}", key_node.start_mark
                )
            seen.add(key)
        return super().construct_mapping(node, deep=deep)


def load_config(path: str | os.PathLike[str], overrides: Mapping[str, Any] | None = None) -> PipelineConfig:
    """Read and validate the YAML file at ``path``; ``overrides`` as in :func:`parse_config`."""
    source = os.fspath(path)
    try:
        text = Path(source).read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ConfigError(source, ["file not found"]) from None
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
    raw = _parse_yaml(data, source) if isinstance(data, str) else data
    if not isinstance(raw, Mapping):
        name = _yaml_type(raw)
        given = "an empty document" if raw is None else f"{'an' if name[0] in 'aeiou' else 'a'} {name}"
        raise ConfigError(source, [f"<top level>: expected a mapping of settings (version, tiers, ...), got {given}"])
    raw = _apply_overrides(raw, overrides or {}, source)
    try:
        return PipelineConfig.model_validate(raw)
    except ValidationError as exc:
        problems = [
            f"{path}: {message}{_override_note(path, overrides)}"
            for error in exc.errors(include_url=False)
            for path, message in _describe(error)
        ]
        raise ConfigError(source, problems) from None


def _parse_yaml(text: str, source: str) -> Any:
    try:
        return yaml.load(text, Loader=_UniqueKeyLoader)  # a SafeLoader subclass: no arbitrary objects
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark or exc.context_mark
        where = f"line {mark.line + 1}, column {mark.column + 1}" if mark else "<yaml>"
        raise ConfigError(source, [f"{where}: invalid YAML: {exc.problem or exc.context}"]) from None
    except yaml.YAMLError as exc:
        raise ConfigError(source, [f"<yaml>: invalid YAML: {exc}"]) from None


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
                problem = f"cannot apply override {dotted!r}: {prefix} is a {_yaml_type(child)}, not a mapping"
                raise ConfigError(source, [f"{prefix}: {problem}"])
            node = child
        node[leaf] = copy.deepcopy(value)
    return result


def _override_note(path: str, overrides: Mapping[str, Any] | None) -> str:
    """Points at the override when a bad value did not come from the file the user is reading."""
    for key in overrides or {}:
        if path == key or path.startswith(key + "."):
            return f" (set by override {key!r})"
    return ""


_EXPECTED = {
    "model_type": "a mapping",
    "model_attributes_type": "a mapping",
    "dict_type": "a mapping",
    "byte_size": "a size such as 16MiB, 1GB or a number of bytes",
    "byte_size_unit": "a size such as 16MiB, 1GB or a number of bytes",
    "path_type": "a path string",
}


def _describe(error: Mapping[str, Any]) -> list[tuple[str, str]]:
    """Turn one pydantic error into ``(key.path, message)`` problems in the YAML's own vocabulary."""
    kind, loc, given = error["type"], tuple(error["loc"]), error.get("input")
    ctx = error.get("ctx") or {}
    if isinstance(ctx.get("error"), _SemanticErrors):
        return ctx["error"].problems
    is_name = bool(loc) and loc[-1] == "[key]"
    keys, owner = _locate(loc[:-1] if is_name else loc)
    path = ".".join(keys) or "<top level>"
    if kind == "extra_forbidden":
        return [(path, _unknown_key(keys[-1], owner))]
    if kind == "missing":
        return [(path, "required key is missing")]
    if kind == "too_short":
        return [(path, "must not be empty")]
    kinds = ", ".join(STAGE_KINDS)
    if kind == "union_tag_not_found":
        return [(f"{path}.kind", f"missing; the stage name is not a kind, so set kind to one of {kinds}")]
    if kind == "union_tag_invalid":
        tag = str(ctx["tag"])
        return [(f"{path}.kind", f"must be one of {kinds}, got {tag!r}{_did_you_mean(tag, STAGE_KINDS)}")]
    if kind == "value_error":
        return [(path, error["msg"].removeprefix("Value error, "))]
    expected = f"must be {_EXPECTED[kind]}" if kind in _EXPECTED else error["msg"].replace("Input should be", "must be")
    if is_name:
        expected = f"invalid name: {expected[0].lower()}{expected[1:]}"
    return [(path, f"{expected}, got {_show(given)}")]


def _locate(loc: tuple[int | str, ...]) -> tuple[list[str], type[BaseModel] | None]:
    """Map a pydantic location to the YAML key path and the model owning its last key.

    Walking the type annotations tells apart a dict key (kept) from a discriminated-union tag that
    pydantic inserts (``stages.compress.compress.level``; dropped), and finds the model whose field
    names are the candidates for an unknown-key suggestion.
    """
    keys: list[str] = []
    owner: type[BaseModel] | None = None
    annotation: Any = PipelineConfig
    for part in loc:
        annotation = _unwrap(annotation)
        if isinstance(annotation, type) and issubclass(annotation, BaseModel):
            owner = annotation
            field = annotation.model_fields.get(str(part))
            annotation = field.annotation if field else None
            keys.append(str(part))
        elif typing.get_origin(annotation) in (Union, types.UnionType):
            # Members are already known models; the union itself adds no key to the YAML path.
            annotation = next((m for m in typing.get_args(annotation) if _tag_of(m) == part), None)
        else:
            annotation = typing.get_args(annotation)[-1] if typing.get_origin(annotation) is dict else None
            keys.append(str(part))
    return keys, owner


def _unwrap(annotation: Any) -> Any:
    """Strip ``Annotated[...]`` and ``X | None`` down to the type that decides the next key."""
    while True:
        origin = typing.get_origin(annotation)
        if origin is Annotated:
            annotation = typing.get_args(annotation)[0]
        elif origin in (Union, types.UnionType):
            members = [m for m in typing.get_args(annotation) if m is not type(None)]
            if len(members) != 1:
                return annotation
            annotation = members[0]
        else:
            return annotation


def _tag_of(model: Any) -> Any:
    """The ``kind`` literal a stage model is selected by in the discriminated union."""
    field = model.model_fields.get("kind") if isinstance(model, type) and issubclass(model, BaseModel) else None
    return field.default if field else None


def _unknown_key(key: str, owner: type[BaseModel] | None) -> str:
    valid = list(owner.model_fields) if owner else []
    hint = _did_you_mean(key, valid)
    return f"unknown key{hint}" if hint or not valid else f"unknown key (valid keys: {', '.join(valid)})"


def _did_you_mean(word: str, candidates: typing.Iterable[str]) -> str:
    close = difflib.get_close_matches(word, list(candidates), n=1, cutoff=0.6)
    return f"; did you mean {close[0]!r}?" if close else ""


def _yaml_type(value: Any) -> str:
    """Type names as a YAML author knows them, not Python's."""
    if value is None:
        return "null"
    for python_type, name in ((bool, "boolean"), (int, "integer"), (float, "number"), (str, "string"),
                              (Mapping, "mapping"), (list, "list")):
        if isinstance(value, python_type):
            return name
    return type(value).__name__


def _show(value: Any) -> str:
    if value is None:
        return "null"
    text = repr(value)
    return f"{text if len(text) <= 60 else text[:57] + '...'} ({_yaml_type(value)})"
