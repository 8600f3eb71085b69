"""``tierstate s3 ACTION s3://bucket/prefix``: the CLI on a bucket tier (tiers/storage/s3tier.py).

ls, verify, push (a directory tier's step up), pull (a step down to a directory tier), prune and gc.
The endpoint is ``--endpoint-url`` or ``$AWS_ENDPOINT_URL`` (botocore reads it), credentials the
standard AWS chain. verify reads every frame through the bucket's byte source (ranged GETs), as
``tierstate verify --tier NAME=s3://...`` does. The regular commands take ``s3://`` tiers too
(src/tierstate/cli/buckets.py); these stay for the scripts that use them.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ..tiers.storage.s3tier import S3Tier


def add_parser(sub: Any) -> None:  # argparse's private subparsers type
    s3 = sub.add_parser("s3", help="checkpoints in an S3 bucket prefix: ls, verify, push, pull, prune, gc")
    actions = s3.add_subparsers(dest="action", required=True, metavar="ACTION")

    def action(name: str, text: str) -> argparse.ArgumentParser:
        parser = actions.add_parser(name, help=text, description=text)
        parser.add_argument("--json", action="store_true", help="print JSON instead of lines")
        parser.add_argument("url", help="s3://bucket/prefix")
        parser.add_argument("--endpoint-url", help="an S3 server other than AWS's (default: $AWS_ENDPOINT_URL)")
        parser.add_argument("--region")
        return parser

    action("ls", "list the committed steps (and steps without a manifest, which are no checkpoints)")
    v = action("verify", "download each step and verify every frame; exit 1 naming any damaged object")
    v.add_argument("steps", nargs="*", type=int, metavar="STEP")
    push = action("push", "upload a committed step of a directory tier (verified first, manifest last)")
    push.add_argument("step", type=int)
    push.add_argument("--from", dest="source", required=True, metavar="PATH", help="the directory tier")
    pull = action("pull", "download a step to a directory tier, verified before it is committed there")
    pull.add_argument("step", type=int)
    pull.add_argument("--to", dest="target", required=True, metavar="PATH", help="the directory tier")
    p = action("prune", "delete all but the newest --keep-last steps (manifest first)")
    p.add_argument("--keep-last", type=int, required=True, metavar="N")
    p.add_argument("--dry-run", action="store_true")
    g = action(
        "gc",
        "remove what killed writers left (objects of steps without a manifest, their incomplete multipart uploads "
        "and claims), never anything of an upload whose claim is live",
    )
    g.add_argument(
        "--older-than", default="1h", metavar="AGE",
        help="grace period, e.g. 30m, 2h (default 1h): a step goes once its claim is stale (its writer gone from "
        "this host, or, from another host, the claim older than this) and its newest object or part is older",
    )  # fmt: skip
    g.add_argument("--dry-run", action="store_true")


def _emit(args: argparse.Namespace, lines: list[str], data: object) -> None:
    print(json.dumps(data, indent=1) if args.json else "\n".join(lines))


def _stored_bytes(tier: S3Tier, step: int) -> int:
    """What verifying ``step`` reads, for its progress bar; 0 if its manifest does not read (verify says why)."""
    from ..tiers.format.format import ManifestError

    try:
        return tier.manifest(step).stored_bytes
    except (ManifestError, FileNotFoundError):
        return 0


def _listed(tier: S3Tier, step: int) -> dict[str, Any]:
    """``s3 ls``'s row of a step with a manifest: committed, or invalid (its manifest does not read) and why."""
    from ..tiers.format.format import ManifestError

    try:
        return {"step": step, "state": "committed", "created": tier.manifest(step).created}
    except ManifestError as exc:
        return {"step": step, "state": f"invalid ({exc})"}


def run_s3(args: argparse.Namespace) -> int:
    # Imported here: the parser imports this module, and --help answers without importing torch.
    from tierstate.errors import UsageError

    from ..tiers.ops.policy import RetentionPolicy
    from ..tiers.ops.verify import verify_step
    from ..tiers.storage.filesystem import FilesystemTier
    from ..tiers.storage.objstore import ObjectStore
    from ..tiers.storage.s3tier import S3Tier
    from . import options
    from .progress import byte_progress
    from .render import size

    store = ObjectStore("bucket", args.url, endpoint_url=options.endpoint_url(args), region=args.region)
    tier = S3Tier("bucket", store)
    tier.store.check()
    progress = byte_progress(not args.json)
    if args.action == "ls":
        steps = tier.steps()
        incomplete = sorted(tier.incomplete_steps())
        rows = [_listed(tier, s) for s in steps]
        rows += [{"step": s, "state": "incomplete (no manifest: not a checkpoint)"} for s in incomplete]
        _emit(args, [f"step-{r['step']}  {r['state']}  {r.get('created', '')}".rstrip() for r in rows], rows)
        return 0
    if args.action == "verify":  # a manifest that does not read fails its step (exit 1), as any damage does
        bad: list[str] = []
        for step in args.steps or tier.steps():
            with progress(f"verify step {step}", _stored_bytes(tier, step)) as advance:
                bad += [f"step {step}: {problem}" for problem in verify_step(tier, step, advance).problems]
        _emit(args, bad or ["every frame verified"], {"problems": bad})
        return 1 if bad else 0
    if args.action == "push":
        source = FilesystemTier("source", Path(args.source))
        if args.step not in source.steps():
            raise UsageError(f"{args.source} holds no committed step {args.step}")
        manifest = source.manifest(args.step)
        with progress(f"push step {args.step}", manifest.stored_bytes) as advance:
            report = tier.upload(source.step_dir(args.step), manifest, advance)
        _emit(args, [f"step {args.step}: {report.outcome} to {report.target} ({size(report.bytes)})"], vars(report))
        return 0
    if args.action == "pull":
        target = FilesystemTier("target", Path(args.target))
        with progress(f"pull step {args.step}", tier.manifest(args.step).stored_bytes) as advance:
            report = tier.download(args.step, target, advance)
        _emit(args, [f"step {args.step}: {report.outcome} to {report.target} ({size(report.bytes)})"], vars(report))
        return 0
    if args.action == "prune":
        steps = tier.steps()
        policy = RetentionPolicy(keep_last=args.keep_last)
        doomed = [s for s in steps if policy.keeps(s, steps) is None]
        if not args.dry_run:
            for step in doomed:
                tier.delete_step(step)
        verb = "would delete" if args.dry_run else "deleted"
        _emit(args, [f"{verb} step {s}" for s in doomed] or ["nothing to delete"], {verb: doomed})
        return 0
    found = tier.collect_garbage(options.duration(args.older_than, "--older-than"), dry_run=args.dry_run)
    verb = "would remove" if args.dry_run else "removed"
    _emit(args, [f"{verb} {f.kind} {f.what}" for f in found] or ["nothing to remove"], [vars(f) for f in found])
    return 0
