"""The checks across the sections of a pipeline config, once each section is valid on its own.

They need well-typed values to reason about, so only a config that passed the schema
(pipeline/config_schema.py) reaches them; each problem is ``(dotted.key.path, message)``, all of
them at once, so one edit fixes them all. The stage graph's own checks are in pipeline/stage_graph.py.
"""

from __future__ import annotations

import importlib.util

from ..tiers.format.hdf5_extra import HDF5_NEEDS_H5PY
from .config_schema import ConfigSchema
from .config_stages import PersistStage
from .stage_graph import chain_problems


def semantic_problems(config: ConfigSchema) -> list[tuple[str, str]]:
    """Every problem of ``config`` across its sections: stage graph, tier references, formats, sizes."""
    graph = list(chain_problems(config.pipeline.stages))
    problems = list(graph)
    for name, stage in config.pipeline.stages.items():
        if isinstance(stage, PersistStage) and stage.tier in config.buckets:
            problems.append((
                f"pipeline.stages.{name}.tier",
                f"tier {stage.tier!r} is a bucket (kind: s3): to persist to it, give it a local staging "
                f"directory (tiers.{stage.tier}.staging), or persist to a directory tier and give the bucket "
                "a flush policy",
            ))
        elif isinstance(stage, PersistStage) and stage.tier not in config.tiers:
            problems.append((
                f"pipeline.stages.{name}.tier",
                f"tier {stage.tier!r} is not defined under tiers (defined: {', '.join(config.tiers)})",
            ))
    if not graph:  # these walk the chain, which a broken graph (a cycle, a dangling next) does not have
        problems += _tier_format_problems(config)
    problems += _bounded_tier_problems(config)
    problems += _flush_problems(config)
    problems += _replica_problems(config)
    if config.host_cache.size < 2 * config.chunk_size:
        chunk = config.chunk_size.human_readable()
        problems.append((
            "host_cache.size",
            (f"{config.host_cache.size.human_readable()} is smaller than 2 * chunk_size "
             f"(2 * {chunk}); the cache must hold two chunks so capture can fill one "
             "while another is being persisted"),
        ))
    return problems


def _tier_format_problems(config: ConfigSchema) -> list[tuple[str, str]]:
    """A flush into the tier being persisted to would copy a checkpoint onto itself; HDF5 datasets
    are stored raw, so they cannot take compressed chunks; and HDF5 is written with h5py, an extra."""
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
    if persist is not None and persist.format == "hdf5" and importlib.util.find_spec("h5py") is None:
        name = next(n for n, s in config.pipeline.stages.items() if s is persist)
        problems.append((f"pipeline.stages.{name}.format", HDF5_NEEDS_H5PY))
    return problems


def _flush_problems(config: ConfigSchema) -> list[tuple[str, str]]:
    """The flush graph goes from faster to slower tiers (tiers/ops/due.py): each ``from`` names a directory tier
    listed before its target that receives checkpoints itself; a bucket is the last hop, and the persist
    bucket is published to, never flushed to."""
    problems = []
    order = list(config.tiers)  # fastest first; the buckets come after every directory
    flushes = [(name, t.flush, "tiers") for name, t in config.tiers.items()]
    flushes += [(name, b.flush, "buckets") for name, b in config.buckets.items()]
    # Not stage_of_kind: it walks the chain, which a broken stage graph (a cycle) does not have.
    persist = next((s.tier for s in config.pipeline.stages.values() if isinstance(s, PersistStage)), None)
    receiving = {persist} | {n for n, f, _ in flushes if f is not None}
    for name, flush, section in flushes:
        if flush is None or flush.source is None or name == persist:
            continue  # the persist tier's own flush is refused by _tier_format_problems
        key = f"tiers.{name}.flush.from"
        source = flush.source
        if section == "buckets" and name == config.persist_bucket:
            problems.append((f"tiers.{name}.flush", (
                f"the persist stage writes to {name!r} (through its staging directory): each checkpoint is "
                "published there before it is durable, so it takes no flush; remove this flush"
            )))  # fmt: skip
        elif source in config.buckets:
            problems.append((key, f"{source!r} is a bucket: a bucket is the slowest tier and flushes to none"))
        elif source not in config.tiers:
            problems.append((key, f"tier {source!r} is not defined under tiers (defined: {', '.join(order)})"))
        elif source == name:
            problems.append((key, "a tier cannot flush to itself"))
        elif section == "tiers" and order.index(source) > order.index(name):
            problems.append((key, (
                f"tiers are listed fastest first and a flush goes towards a slower tier, but {source!r} is "
                f"listed after {name!r}: list {source!r} first, or flush the other way"
            )))  # fmt: skip
        elif source not in receiving:
            problems.append((key, (
                f"tier {source!r} receives no checkpoints (it is not the persist tier and has no flush), "
                f"so {name!r} would never get one"
            )))  # fmt: skip
    return problems


def _replica_problems(config: ConfigSchema) -> list[tuple[str, str]]:
    """Peer copies are of a node's part, so only a node-scoped tier has them, and only when the
    checkpoint commits in node parts (a node-scoped persist tier)."""
    problems = []
    persist = next((s.tier for s in config.pipeline.stages.values() if isinstance(s, PersistStage)), None)
    for name, tier in config.tiers.items():
        if not tier.replicas:
            continue
        if tier.scope != "node":
            problems.append((
                f"tiers.{name}.replicas",
                "peer copies put a node's part on a partner node; only a scope: node tier has them "
                "(a shared tier is one copy every node sees)",
            ))
        elif persist in config.tiers and config.tiers[persist].scope != "node":
            problems.append((
                f"tiers.{name}.replicas",
                f"peer copies are of a node's part, but the persist tier {persist!r} is shared: make it scope: node",
            ))
    return problems


def _bounded_tier_problems(config: ConfigSchema) -> list[tuple[str, str]]:
    """A memory tier must be node-scoped and bounded; a bounded tier needs retention to make room, and
    room for at least a chunk. (Whether it holds a whole checkpoint is known only at the first
    checkpoint: that fails naming ``tiers.NAME.size``, see pipeline/room.py.)"""
    problems = []
    for name, tier in config.tiers.items():
        if tier.kind == "memory" and tier.scope != "node":
            problems.append((
                f"tiers.{name}.scope",
                "a memory tier is each node's own host memory; it must be scope: node (its default)",
            ))
        if tier.kind == "memory" and tier.size is None:
            problems.append((
                f"tiers.{name}.size",
                "a memory tier needs a size bound (e.g. size: 8GiB): the host memory it fills is the job's too; "
                "give it room for keep_last + 1 checkpoints of this node (the kept ones and the one in flight)",
            ))
        if tier.kind != "memory" and tier.slots:
            problems.append((
                f"tiers.{name}.slots",
                "slots are a memory tier's preallocated files in host memory (kind: memory); a disk tier has none",
            ))
        if tier.size is None:
            continue
        if not tier.retention.active:
            problems.append((
                f"tiers.{name}.retention",
                f"a tier with a size bound ({tier.size.human_readable()}) needs a retention policy "
                "(e.g. {keep_last: 1}), or it is full after a few checkpoints",
            ))
        if tier.size < config.chunk_size:
            problems.append((
                f"tiers.{name}.size",
                f"{tier.size.human_readable()} is smaller than chunk_size ({config.chunk_size.human_readable()}); "
                "it cannot hold one checkpoint",
            ))
    return problems
