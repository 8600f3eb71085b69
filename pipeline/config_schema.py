"""The pipeline YAML's schema: every section as a strict, immutable pydantic model.

Pydantic checks types, ranges and unknown keys here and collects every error; the checks across
sections (stage graph, tier references, sizes) are in pipeline/config_checks.py, and
:class:`~tierstate.pipeline.config.PipelineConfig` (pipeline/config.py, which also loads files)
is this schema with those checks passed. Defaults that follow from other keys (the persist tier,
the packaged default's stage chain, the chunk size) are filled in before validation, here.
"""

from __future__ import annotations

import copy
import functools
import os
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Annotated, Any, Literal, overload

from pydantic import (
    AfterValidator,
    ByteSize,
    Field,
    StrictBool,
    StrictInt,
    StringConstraints,
    TypeAdapter,
    ValidationError,
    field_validator,
    model_validator,
)

from ..tiers.ops.policy import FlushGraph, FlushPolicy, RetentionPolicy
from ..tiers.storage.nodes import expand_node
from ..tiers.storage.s3url import endpoint_problem, s3_url_problem
from .config_errors import ConfigError, read_yaml
from .config_stages import (
    CompressStage,
    MiB,
    PersistStage,
    PipelineSpec,
    StageConfig,
    StageKind,
    Strict,
    at_least,
)
from .packaged import DEFAULT_NAME, packaged_config

# The default chunk: each chunk is handed between pipeline threads, and each hand-over takes the GIL from
# the trainer for a moment; 64MiB chunks cost a Python-bound trainer 1.6-2x less step time than 16MiB,
# durable and cold restore as fast or faster, warm restore 1.6x faster (benchmarks/RESULTS.md).
DEFAULT_CHUNK = 64 * MiB
_SIZE = TypeAdapter(ByteSize)


def default_chunk_size(bounds: list[int]) -> int:
    """``chunk_size`` when the config leaves it out: DEFAULT_CHUNK, or a quarter of the smallest of
    ``bounds`` (the host cache, the bounded tiers) where that is less, in whole MiB, at least 1MiB: the
    cache must hold two chunks, and a bounded tier at least one checkpoint."""
    quarter = min(bounds, default=DEFAULT_CHUNK * 4) // 4 // MiB * MiB
    return max(MiB, min(DEFAULT_CHUNK, quarter))


def _size_or_none(value: object) -> int | None:
    """A size as the YAML gives it (``64MiB``, bytes), or None where invalid (reported at its own key)."""
    try:
        return int(_SIZE.validate_python(value))
    except ValidationError:
        return None


def _power_of_two_alignment(value: ByteSize) -> ByteSize:
    """Frames are aligned for O_DIRECT, which needs a power of two from the sector size (512) up."""
    if not 512 <= value <= MiB or value & (value - 1):
        raise ValueError(f"must be a power of two between 512 and 1048576 (1MiB), got {int(value)}")
    return value


class HostCacheConfig(Strict):
    """The fixed host buffer pool; allocated once so memory stays bounded and pinning is paid once."""

    size: ByteSize = ByteSize(256 * MiB)
    pinned: Literal["auto", True, False] = "auto"


class TierConfig(Strict):
    """One durable filesystem tier (local NVMe, a parallel file system mount, any directory).

    ``retention`` says which checkpoints it keeps; ``flush`` makes it receive background copies of
    the checkpoints the persist tier commits (see tiers/ops/policy.py). ``scope: node``: each node has its
    own directory (local NVMe, memory), holding only its ranks' files; ``{node}`` in the path stands
    for the node's name (tiers/storage/nodes.py). ``shared``: one directory every rank sees (PFS).

    ``kind: memory``: a directory in host shared memory (a tmpfs such as ``/dev/shm``), whose
    checkpoints outlive the training process (not the node) so a restart restores from RAM. It is
    node-scoped (the default scope for it) and needs ``size``, the most bytes it may hold on a
    node: host memory is the job's too. ``size`` bounds any tier; a checkpoint that would not fit
    waits for the tier's older copies to be flushed and pruned, or fails naming this key.

    ``slots`` (a memory tier only; on by default): capture copies each tensor straight into the tier's
    preallocated, mapped data files, which retention hands back instead of deleting
    (pipeline/slotjob.py); ``false`` writes them through the host cache, as a disk tier is written.

    ``replicas: 1`` on a node-scoped tier: each node's part committed there is also sent to a partner
    node's tier (the next node, in a ring), so a replaced node restores its part from the partner
    rather than the shared tier (pipeline/peers.py).
    """

    path: Path
    kind: Literal["disk", "memory"] = "disk"
    scope: Literal["node", "shared"] = "shared"
    size: Annotated[ByteSize, at_least(1)] | None = None
    retention: RetentionPolicy = RetentionPolicy()
    flush: FlushPolicy | None = None
    replicas: Annotated[int, Field(ge=0, le=1)] = 0
    slots: StrictBool | None = None  # None: a memory tier's default (on)

    @model_validator(mode="before")
    @classmethod
    def _memory_is_node_scoped(cls, data: Any) -> Any:
        # A memory tier is each node's own RAM, so that is its scope unless the YAML says otherwise
        # (which _bounded_tier_problems then refuses, naming the key).
        if isinstance(data, Mapping) and data.get("kind") == "memory" and "scope" not in data:
            return {**data, "scope": "node"}
        return data

    @field_validator("path", mode="before")
    @classmethod
    def _absolute(cls, value: Any) -> Any:
        # Resolved once at load time so a later os.chdir in the trainer cannot redirect writes.
        # An empty path would silently mean the working directory, so it is refused.
        if not isinstance(value, str | os.PathLike):
            return value  # pydantic reports the wrong type
        if not os.fspath(value).strip():
            raise ValueError("must not be empty")
        return os.path.abspath(os.path.expanduser(expand_node(os.fspath(value))))


def _told(problem_of: Callable[[str], str | None]) -> Callable[[str], str]:
    """A validator from a check that says what is wrong in words (an example, never a pattern)."""

    def check(value: str) -> str:
        problem = problem_of(value)
        if problem is not None:
            raise ValueError(problem)
        return value

    return check


class S3TierConfig(Strict):
    """A tier in an S3-compatible bucket (AWS S3, MinIO, Ceph RGW, GCS's S3 API): ``kind: s3``.

    ``url`` is ``s3://bucket/prefix``; ``endpoint_url`` a server other than AWS's (MinIO, a local
    one); credentials come from the standard AWS chain (environment, profile, instance role), never
    from the YAML. It receives flushes (``flush``, as a directory tier does) and keeps what
    ``retention`` says; it is read when no local tier holds a checkpoint (tiers/storage/s3tier.py).

    As the persist stage's tier, each checkpoint is written to ``staging`` (a local directory, kept
    as a tier named ``<name>-staging`` with ``keep_last: 1`` and scope ``staging_scope``: ``node``
    for each node's own NVMe, ``{node}`` in the path standing for its name) and uploaded, the
    manifest last with a conditional put, before the checkpoint is reported durable; with many
    ranks each uploads its own files and rank 0 the manifest (pipeline/buckets.py).
    """

    kind: Literal["s3"]
    url: Annotated[str, AfterValidator(_told(s3_url_problem))]
    endpoint_url: Annotated[str, AfterValidator(_told(endpoint_problem))] | None = None
    region: str | None = None
    retention: RetentionPolicy = RetentionPolicy()
    flush: FlushPolicy | None = None
    staging: str | None = None
    staging_scope: Literal["node", "shared"] = "shared"


class PoliciesConfig(Strict):
    """Behaviour choices that are not about moving bytes."""

    in_flight: Literal["wait", "skip"] = "wait"
    allow_pickle: StrictBool = False
    # Debugging aid, off by default (it hashes every lazily captured tensor twice on the trainer's
    # side): fail a checkpoint whose lazily captured tensors changed between request and copy.
    check_capture: StrictBool = False


class CadenceConfig(Strict):
    """When ``runner.maybe_checkpoint(step)`` checkpoints (pipeline/cadence.py): every ``every`` steps, or with
    ``auto`` as often as the measured cost stays within ``budget`` of the training time (0.03: 3%), after
    ``warmup`` plain steps timed."""

    every: Annotated[StrictInt, Field(ge=1)] | Literal["auto"] = "auto"
    budget: Annotated[float, Field(gt=0, le=1)] = 0.03
    warmup: Annotated[StrictInt, Field(ge=1)] = 3


class AgentConfig(Strict):
    """The node agent (pipeline/agent.py): ``enabled``, flushes and retention run in a process of their own per
    node that outlives the trainer, niced by ``nice``, instead of in the trainer's process. After a trainer died
    (its runner never closed) the agent waits ``linger`` seconds for the restart to attach to it, which then
    starts no agent of its own; once every trainer closed its runner it ends as soon as nothing is left to do."""

    enabled: StrictBool = False
    nice: Annotated[StrictInt, Field(ge=0, le=19)] = 10
    linger: Annotated[float, Field(ge=0)] = 120.0


TierName = Annotated[str, StringConstraints(pattern=r"^[a-z][a-z0-9_-]*$")]
Tiers = Annotated[dict[TierName, TierConfig], Field(min_length=1)]
TIERS: TypeAdapter[dict[str, TierConfig]] = TypeAdapter(Tiers)


def _persist_through_staging(data: dict[str, Any], buckets: Mapping[str, Any]) -> dict[str, Any]:
    """A persist stage naming a bucket with ``staging``: it writes to the staging directory, put first
    among the tiers as ``<bucket>-staging`` (kept: the newest step), and ``persist_bucket`` names the
    bucket the runner uploads each checkpoint to before it is durable. Without ``staging`` it is left
    as it is, and the cross-section checks refuse it, naming the key."""
    pipeline = data.get("pipeline")
    stages = pipeline.get("stages") if isinstance(pipeline, Mapping) else None
    if not isinstance(pipeline, Mapping) or not isinstance(stages, Mapping):
        return data
    for name, stage in stages.items():
        named = stage.get("tier") if isinstance(stage, Mapping) and stage.get("kind", name) == "persist" else None
        bucket = buckets.get(named) if isinstance(named, str) else None
        if isinstance(bucket, Mapping) and bucket.get("staging"):
            staging = f"{named}-staging"
            scope = bucket.get("staging_scope", S3TierConfig.model_fields["staging_scope"].default)
            tier = {"path": bucket["staging"], "scope": scope, "retention": {"keep_last": 1}}
            tiers = {staging: tier, **data["tiers"]}
            stages = {**stages, name: {**stage, "tier": staging}}
            return {**data, "tiers": tiers, "pipeline": {**pipeline, "stages": stages}, "persist_bucket": named}
    return data


def _with_source(tier: Any, persist: str) -> Any:
    """``tier`` (a raw tier mapping) with ``flush.from`` set to ``persist`` where its flush names no source."""
    if not isinstance(tier, Mapping) or not isinstance(tier.get("flush"), Mapping) or "from" in tier["flush"]:
        return tier
    return {**tier, "flush": {**tier["flush"], "from": persist}}


class ConfigSchema(Strict):
    """The whole spec, each section valid on its own; :class:`~tierstate.pipeline.config.PipelineConfig`
    adds the checks across sections, so only that one is sure to have a well-formed stage chain."""

    version: StrictInt = 1
    # Left out: default_chunk_size() of the host cache and the bounded tiers (_default_chunk_size).
    chunk_size: Annotated[ByteSize, at_least(MiB)] = ByteSize(DEFAULT_CHUNK)
    align: Annotated[ByteSize, AfterValidator(_power_of_two_alignment)] = ByteSize(4096)
    host_cache: HostCacheConfig = HostCacheConfig()
    tiers: Tiers
    #: The ``kind: s3`` entries of ``tiers``, moved here when the YAML is read (``_buckets_apart``): every
    #: reader of ``tiers`` works on directories, a bucket is flushed to and read by pipeline/buckets.py.
    buckets: dict[TierName, S3TierConfig] = {}
    #: The bucket the persist stage names (its ``staging`` directory is the tier the stage writes to),
    #: set by ``_buckets_apart``; None when the persist tier is a directory.
    persist_bucket: TierName | None = None
    pipeline: PipelineSpec  # left out: the packaged default's stage chain (see _defaults_from_tiers)
    policies: PoliciesConfig = PoliciesConfig()
    cadence: CadenceConfig = CadenceConfig()
    agent: AgentConfig = AgentConfig()

    @model_validator(mode="before")
    @classmethod
    def _flush_sources(cls, data: Any) -> Any:
        """A ``flush`` without ``from`` flushes from the tier the persist stage writes to: named here, so
        that every reader of the config (the runner, the CLI, retention) sees each source spelled out.
        Defined first so that it runs last, once the persist stage's tier is known (staging included)."""
        if not isinstance(data, Mapping):
            return data
        pipeline = data.get("pipeline")
        stages = pipeline.get("stages") if isinstance(pipeline, Mapping) else None
        persist = next(
            (stage.get("tier") for name, stage in stages.items()
             if isinstance(stage, Mapping) and stage.get("kind", name) == "persist"),
            None,
        ) if isinstance(stages, Mapping) else None  # fmt: skip
        if not isinstance(persist, str):
            return data  # the checks report the missing persist stage or tier
        filled = dict(data)
        for section in ("tiers", "buckets"):
            tiers = data.get(section)
            if isinstance(tiers, Mapping):
                filled[section] = {name: _with_source(tier, persist) for name, tier in tiers.items()}
        return filled

    @model_validator(mode="before")
    @classmethod
    def _defaults_from_tiers(cls, data: Any) -> Any:
        """Defaults that follow from the tiers: a persist stage without ``tier`` writes to the first
        (fastest) tier, and a config without ``pipeline`` gets the packaged default's stage chain,
        writing there too; so ``{"tiers": {...}}`` alone is a complete config."""
        if not isinstance(data, Mapping):
            return data
        tiers = data.get("tiers")
        first = next(iter(tiers), None) if isinstance(tiers, Mapping) else None
        if "pipeline" in data:
            pipeline = data["pipeline"]
        else:
            pipeline = packaged_default_pipeline()
            if first is not None:  # else the default's own tier stays, and only the tiers are reported
                for stage in pipeline["stages"].values():
                    stage.pop("tier", None)
        stages = pipeline.get("stages") if isinstance(pipeline, Mapping) else None
        if first is None or not isinstance(stages, Mapping):
            return {**data, "pipeline": pipeline}  # pydantic reports what is wrong
        filled = {
            name: {**stage, "tier": first}
            if isinstance(stage, Mapping) and "tier" not in stage and stage.get("kind", name) == "persist"
            else stage
            for name, stage in stages.items()
        }
        return {**data, "pipeline": {**pipeline, "stages": filled}}

    @model_validator(mode="before")
    @classmethod
    def _buckets_apart(cls, data: Any) -> Any:
        # Defined after _defaults_from_tiers so that it runs first (pydantic runs 'before' validators
        # last-defined first): the persist tier defaults to the first tier that is a directory.
        if not isinstance(data, Mapping) or not isinstance(data.get("tiers"), Mapping):
            return data
        tiers = data["tiers"]
        buckets = {n: t for n, t in tiers.items() if isinstance(t, Mapping) and t.get("kind") == "s3"}
        if not buckets:
            return data
        rest = {n: t for n, t in tiers.items() if n not in buckets}
        data = {**data, "tiers": rest, "buckets": {**data.get("buckets", {}), **buckets}}
        return _persist_through_staging(data, buckets)

    @model_validator(mode="before")
    @classmethod
    def _default_chunk_size(cls, data: Any) -> Any:
        """``chunk_size`` left out: from the sizes the config bounds (default_chunk_size), so that a
        config with a small host cache is valid without naming a chunk size that fits it."""
        if not isinstance(data, Mapping) or "chunk_size" in data:
            return data
        cache = data.get("host_cache")
        bounds = [cache["size"] if isinstance(cache, Mapping) and "size" in cache else HostCacheConfig().size]
        tiers = data.get("tiers")
        if isinstance(tiers, Mapping):
            bounds += [tier["size"] for tier in tiers.values() if isinstance(tier, Mapping) and "size" in tier]
        sizes = [size for size in map(_size_or_none, bounds) if size is not None]
        return {**data, "chunk_size": default_chunk_size(sizes)}

    @field_validator("version")
    @classmethod
    def _supported_version(cls, value: int) -> int:
        if value != 1:
            raise ValueError(f"unsupported version {value}; only version 1 is supported")
        return value

    def chain(self) -> list[tuple[str, StageConfig]]:
        """Stages in data-flow order, from capture to persist."""
        stages = self.pipeline.stages
        name: str | None = next(n for n, s in stages.items() if s.kind == "capture")
        ordered: list[tuple[str, StageConfig]] = []
        while name is not None:
            ordered.append((name, stages[name]))
            name = stages[name].next
        return ordered

    def threads_for(self, kind: StageKind) -> int:
        """How many threads may run the stage of ``kind`` at once: its workers, or with ``workers: 0``
        those of the nearest stage before it that has some (pipeline/lanes.py); 0 without that stage."""
        threads = 0
        for _, stage in self.chain():
            threads = stage.workers or threads
            if stage.kind == kind:
                return threads
        return 0

    @overload
    def stage_of_kind(self, kind: Literal["persist"]) -> PersistStage | None: ...
    @overload
    def stage_of_kind(self, kind: Literal["compress"]) -> CompressStage | None: ...
    @overload
    def stage_of_kind(self, kind: str) -> StageConfig | None: ...
    def stage_of_kind(self, kind: str) -> StageConfig | None:
        """The stage of ``kind`` (each kind occurs at most once), or None, e.g. without compress."""
        return next((stage for _, stage in self.chain() if stage.kind == kind), None)

    def flush_graph(self) -> FlushGraph:
        """What is due where (tiers/ops/due.py): the flush edges of the tiers and buckets. The persist bucket
        is published to by the checkpoint itself, never flushed to."""
        flushes = [(name, tier.flush) for name, tier in self.tiers.items()]
        flushes += [(name, b.flush) for name, b in self.buckets.items() if name != self.persist_bucket]
        return FlushGraph.of(flushes, self.persist_tier)

    @property
    def persist_tier(self) -> str:
        """The tier the pipeline writes to; later tiers are reached by migration."""
        persist = self.stage_of_kind("persist")
        if persist is None:  # only a schema-valid config that skipped the graph checks (PipelineConfig's) lacks one
            raise ConfigError("<config>", ["pipeline.stages: no persist stage, so no tier to write to"])
        return persist.tier


@functools.cache
def _packaged_default() -> dict[str, Any]:
    path = packaged_config(DEFAULT_NAME)
    return read_yaml(path.read_text(encoding="utf-8"), str(path))


def packaged_default_pipeline() -> dict[str, Any]:
    """The ``pipeline`` section of the packaged default, a fresh copy for the caller to change."""
    return copy.deepcopy(_packaged_default()["pipeline"])
