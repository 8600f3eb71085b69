"""Tiers and option values from a parsed ``tierstate`` command line.

Tiers are read exactly as the runner reads them: a ``--config`` YAML (or a packaged config by name)
goes through :func:`~tierstate.pipeline.config.load_config`, so a key written twice, an unknown key
anywhere (under ``pipeline:`` too) and every bad value are refused with the file and the key path,
and relative tier paths are resolved as the runner resolves them (against the working directory, see
``TierConfig``). ``--tier NAME=PATH`` goes through the same tier model. A bucket (``kind: s3`` in
the YAML, or ``--tier NAME=s3://bucket/prefix``) is a :class:`~cli.buckets.BucketPolicies`,
its endpoint the YAML's ``endpoint_url``, else ``--endpoint-url``, else ``$AWS_ENDPOINT_URL``
(botocore reads it), its credentials the standard AWS chain; it is checked (credentials, bucket)
when built, so a command fails at once naming it. A config the runner refuses
is one the CLI refuses: retention read differently by the two could delete checkpoints the runner
keeps. The commands (src/tierstate/cli/commands.py) take the tiers and policies built here, never YAML.
"""

from __future__ import annotations

import argparse
import os
import re
import sys
from collections.abc import Collection, Sequence
from typing import TypeVar

from pydantic import ByteSize, TypeAdapter, ValidationError

from tierstate.errors import UsageError

from ..pipeline.config import PipelineConfig, load_config, parse_tiers
from ..pipeline.config_schema import TierConfig
from ..pipeline.packaged import packaged_configs
from ..suggest import did_you_mean
from ..tiers.ops.policy import FlushPolicy, RetentionPolicy
from ..tiers.ops.retention import BucketPolicies, TierPolicies
from ..tiers.storage.filesystem import FilesystemTier
from ..tiers.storage.nodes import as_node
from ..tiers.storage.objstore import ObjectStore
from ..tiers.storage.s3tier import S3Tier
from ..tiers.storage.s3url import endpoint_problem

AnyPolicies = TierPolicies | BucketPolicies
P = TypeVar("P", bound=AnyPolicies)

T = TypeVar("T")

_DURATION_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([smhd]?)\s*$")
_SECONDS = {"": 1, "s": 1, "m": 60, "h": 3600, "d": 86400}


# --- tiers from --config and --tier -------------------------------------------------------------
def _policies(name: str, tier: TierConfig) -> TierPolicies:
    return TierPolicies(FilesystemTier(name, tier.path, tier.scope), tier.retention, tier.flush)


def _tier_option(spec: str) -> TierPolicies:
    name, sep, path = spec.partition("=")
    if not sep or not name or not path:
        raise UsageError(f"--tier {spec!r}: expected NAME=PATH")
    [(name, tier)] = parse_tiers({name: {"path": path}}, source=f"--tier {spec!r}").items()
    return _policies(name, tier)


def _is_bucket(spec: str) -> bool:
    return spec.partition("=")[2].startswith("s3://")


def load_tiers(config: str | None, tier_options: Sequence[str] | None) -> list[TierPolicies]:
    """The directory tiers of ``--config`` (with their policies, read as the runner reads them),
    followed by those of ``--tier NAME=PATH`` (no policies); buckets are :func:`load_buckets`'."""
    loaded = load_config(config) if config else None
    tiers = [_policies(name, tier) for name, tier in loaded.tiers.items()] if loaded else []
    tiers += [_tier_option(spec) for spec in tier_options or [] if not _is_bucket(spec)]
    if not tiers and not (loaded and loaded.buckets) and not any(map(_is_bucket, tier_options or [])):
        packaged = ", ".join(packaged_configs())
        raise UsageError(f"no tiers: give --config FILE (or a packaged config: {packaged}) or --tier NAME=PATH")
    names = [t.tier.name for t in tiers]
    repeated = sorted({n for n in names if names.count(n) > 1})
    if repeated:
        raise UsageError(f"tier {repeated[0]!r} is given twice")
    return tiers


def endpoint_url(args: argparse.Namespace) -> str | None:
    """``--endpoint-url``, if given and a URL botocore takes (the error names the option)."""
    problem = endpoint_problem(args.endpoint_url) if args.endpoint_url else None
    if problem is not None:
        raise UsageError(f"--endpoint-url {problem}")
    return args.endpoint_url


def _bucket(
    name: str,
    url: str,
    endpoint: str | None,
    region: str | None,
    keep: RetentionPolicy,
    flush: FlushPolicy | None = None,
) -> BucketPolicies:
    store = ObjectStore(name, url, endpoint_url=endpoint, region=region)
    store.check()
    return BucketPolicies(S3Tier(name, store), keep, flush)


def load_buckets(args: argparse.Namespace) -> list[BucketPolicies]:
    """The buckets of ``--config`` (``kind: s3``, with their retention and flush; the persist bucket is
    published to, never flushed to) and of ``--tier NAME=s3://...``."""
    buckets = []
    if args.config:
        config = load_config(args.config)
        for name, spec in config.buckets.items():
            endpoint = spec.endpoint_url or endpoint_url(args)
            flush = spec.flush if name != config.persist_bucket else None
            buckets.append(_bucket(name, spec.url, endpoint, spec.region, spec.retention, flush))
    for spec in args.tier or []:
        if _is_bucket(spec):
            name, _, url = spec.partition("=")
            buckets.append(_bucket(name, url, endpoint_url(args), args.region, RetentionPolicy()))
    return buckets


def bucket_at(url: str, args: argparse.Namespace) -> BucketPolicies:
    """A bucket given by its URL alone (``tierstate inspect s3://...``), named ``bucket``."""
    return _bucket("bucket", url, endpoint_url(args), args.region, RetentionPolicy())


def every_tier(args: argparse.Namespace) -> list[AnyPolicies]:
    """The directory tiers of the options, then the buckets; a name given twice is refused."""
    tiers: list[AnyPolicies] = [*tiers_of(args), *load_buckets(args)]
    names = [t.tier.name for t in tiers]
    repeated = sorted({n for n in names if names.count(n) > 1})
    if repeated:
        raise UsageError(f"tier {repeated[0]!r} is given twice")
    return tiers


def split(tiers: Sequence[AnyPolicies]) -> tuple[list[TierPolicies], list[BucketPolicies]]:
    """The directory tiers and the buckets of ``tiers``, each in order."""
    return [t for t in tiers if isinstance(t, TierPolicies)], [t for t in tiers if isinstance(t, BucketPolicies)]


def tiers_of(args: argparse.Namespace) -> list[TierPolicies]:
    """The tiers of the options; with ``--node``, node-scoped tier paths are that node's (``{node}``)."""
    if not args.node:
        return load_tiers(args.config, args.tier)
    with as_node(args.node):
        return load_tiers(args.config, args.tier)


def load_config_at(config: str, node: str | None) -> PipelineConfig:
    """The whole config of ``--config``, node-scoped tier paths as node ``node`` sees them (``--node``)."""
    if not node:
        return load_config(config)
    with as_node(node):
        return load_config(config)


def must_exist(read: Sequence[FilesystemTier]) -> None:
    """At least one of the tiers a command reads must be there: else a mistyped path, or a config's
    relative paths taken from another directory, would list nothing and exit 0. One that is not there
    is noted on stderr and read as empty (a tier may not be written yet, e.g. a flush tier before its
    first flush)."""
    missing = [tier for tier in read if not tier.root.is_dir()]
    if missing and len(missing) == len(read):
        where = ", ".join(f"{tier.name} ({tier.root})" for tier in missing)
        raise UsageError(
            f"no such tier directory: {where}; relative paths are taken from the working directory ({os.getcwd()})"
        )
    for tier in missing:
        print(f"tierstate: note: tier {tier.name} has no directory {tier.root} (yet); taken as empty", file=sys.stderr)


def pick(tiers: Sequence[P], name: str, option: str) -> P:
    """The tier called ``name``; the error names the option and the tiers there are."""
    for policies in tiers:
        if policies.tier.name == name:
            return policies
    known = [t.tier.name for t in tiers]
    raise UsageError(f"{option} {name}: no such tier{did_you_mean(name, known)} (tiers: {', '.join(known)})")


def select(tiers: Sequence[P], names: Sequence[str] | None, option: str) -> list[P]:
    """The tiers named by a repeatable option, in tier order; all of them when it was not given."""
    if not names:
        return list(tiers)
    chosen = {pick(tiers, name, option).tier.name for name in names}
    return [t for t in tiers if t.tier.name in chosen]


# --- option values ------------------------------------------------------------------------------
def duration(text: str, option: str) -> float:
    """Seconds from ``90``, ``30s``, ``10m``, ``2h`` or ``1d``."""
    match = _DURATION_RE.match(text)
    if match is None:
        raise UsageError(f"{option} {text!r}: expected a duration such as 90, 30s, 10m, 2h or 1d")
    return float(match.group(1)) * _SECONDS[match.group(2)]


def size(text: str, option: str) -> int:
    """Bytes from ``200MB``, ``1GiB`` or a plain number, as sizes are written in the config."""
    try:
        size = int(TypeAdapter(ByteSize).validate_python(text))
    except ValidationError:
        raise UsageError(f"{option} {text!r}: expected a size such as 200MB, 1GiB or a number of bytes") from None
    if size <= 0:
        raise UsageError(f"{option} {text!r}: must be more than 0 bytes")
    return size


def choice(text: str | None, choices: Collection[T], option: str) -> T | None:
    """``text`` if it is one of ``choices`` (or None, the option not given); else the option is named."""
    for choice in choices:
        if text == choice:
            return choice
    if text is not None:
        names = list(map(str, choices))
        raise UsageError(f"{option} {text!r}: expected one of {', '.join(names)}{did_you_mean(text, names)}")
    return None
