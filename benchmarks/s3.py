"""Object storage: flush to a bucket and restore from it vs the client alone, and DCP's FsspecWriter.

One local S3 server (moto's ThreadedMotoServer on 127.0.0.1) for the whole run; rounds interleave
the methods (A B C A B C), each method's median reported, and the ratios are taken in this run:

- upload: tierstate's flush of a committed NVMe checkpoint to the bucket (S3Tier.upload: verify the
  frames, multipart with a CRC32 per part, manifest last) vs boto3 alone uploading the same files as
  plain objects with the same part size and threads (the client's own bandwidth), vs DCP's
  ``FsspecWriter`` saving the same state to ``s3://`` (s3fs);
- download: S3Tier.download to an empty local tier (parallel ranged GETs, every frame verified,
  committed) vs boto3 alone downloading the same objects with the same ranges and threads, vs
  ``FsspecReader`` + ``dcp.load``.

moto keeps objects in this process's memory, so absolute numbers say little about a real bucket:
the ratios are what the issue's targets (>= 80%) are about.

    PYTHONPATH=. .venv/bin/python benchmarks/s3.py --size 256MiB --repeats 3
"""

# ruff: noqa: B023  (each round's lambdas run within that round, so binding its variables late is right)
from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

MiB = 1 << 20
CREDENTIALS = {"AWS_ACCESS_KEY_ID": "bench", "AWS_SECRET_ACCESS_KEY": "bench-secret", "AWS_DEFAULT_REGION": "us-east-1"}


def _plain_upload(client, bucket: str, prefix: str, files: list[Path], part: int, workers: int) -> None:  # noqa: ANN001
    """boto3 alone: each file as an object, multipart in ``part`` bytes over ``workers`` threads."""
    from boto3.s3.transfer import TransferConfig

    config = TransferConfig(multipart_threshold=part, multipart_chunksize=part, max_concurrency=workers)
    for path in files:
        client.upload_file(str(path), bucket, f"{prefix}/{path.name}", Config=config)


def _plain_download(client, bucket: str, prefix: str, target: Path, part: int, workers: int) -> None:  # noqa: ANN001
    """boto3 alone: every object under ``prefix`` by ranged GETs of ``part`` bytes over ``workers`` threads."""
    target.mkdir(parents=True, exist_ok=True)
    listed = client.list_objects_v2(Bucket=bucket, Prefix=prefix + "/")["Contents"]
    for obj in listed:
        size = obj["Size"]
        fd = os.open(target / obj["Key"].rsplit("/", 1)[1], os.O_CREAT | os.O_WRONLY | os.O_TRUNC)
        try:
            def chunk(offset: int, key: str = obj["Key"], size: int = size, fd: int = fd) -> None:
                end = min(size, offset + part) - 1
                data = client.get_object(Bucket=bucket, Key=key, Range=f"bytes={offset}-{end}")["Body"].read()
                os.pwrite(fd, data, offset)

            with ThreadPoolExecutor(workers) as pool:
                list(pool.map(chunk, range(0, size, part)))
        finally:
            os.close(fd)


def _timed(fn: Callable[[], object]) -> float:
    started = time.perf_counter()
    fn()
    return time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--size", default="256MiB", help="state size (float32 tensors of 16 MiB)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--workers", type=int, default=8)
    parser.add_argument("--part", type=int, default=16, help="part / range size in MiB")
    parser.add_argument("--results-dir", default="benchmarks/results")
    args = parser.parse_args()
    os.environ.update(CREDENTIALS)
    logging.getLogger("werkzeug").setLevel(logging.ERROR)  # moto's request log
    import boto3
    from moto.server import ThreadedMotoServer

    from tierstate import Runner
    from tierstate.providers import TensorDictProvider
    from tierstate.tiers.storage.filesystem import FilesystemTier
    from tierstate.tiers.storage.objstore import ObjectStore
    from tierstate.tiers.storage.s3tier import S3Tier

    size = int(args.size.removesuffix("MiB")) * MiB
    part = args.part * MiB
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    endpoint = f"http://{host}:{port}"
    client = boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1")
    client.create_bucket(Bucket="bench")
    work = Path(tempfile.mkdtemp(prefix="tierstate-bench-s3-"))
    state = {f"t{i}": torch.randn(16 * MiB // 4) for i in range(size // (16 * MiB))}
    runner = Runner.from_yaml(None, {"tiers": {"nvme": {"path": str(work / "nvme")}}, "chunk_size": "16MiB"})
    runner.register(model=TensorDictProvider(state))
    source = Path(runner.checkpoint(1).result().path)
    runner.close()
    nvme = FilesystemTier("nvme", work / "nvme")
    files = sorted(p for p in source.iterdir() if p.name != "manifest.json")
    nbytes = sum(p.stat().st_size for p in files)

    try:
        import s3fs  # noqa: F401 - FsspecWriter needs it for s3://
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader, FsspecWriter
        have_dcp = True
    except ImportError as exc:
        print(f"DCP FsspecWriter on s3:// skipped: {exc}")
        have_dcp = False

    times: dict[str, list[float]] = {k: [] for k in ("upload/tierstate", "upload/boto3", "upload/dcp-fsspec",
                                                     "download/tierstate", "download/boto3", "download/dcp-fsspec")}
    for round_ in range(args.repeats):
        tier = S3Tier("bucket", ObjectStore("bucket", f"s3://bench/ts{round_}", endpoint_url=endpoint,
                                            workers=args.workers, part_size=part))
        local = FilesystemTier("restored", work / f"restored{round_}")
        dcp_url = f"s3://bench/dcp{round_}"
        into = {"model": {k: torch.empty_like(v) for k, v in state.items()}}
        runs: dict[str, Callable[[], object]] = {
            "upload/tierstate": lambda: tier.upload(source, nvme.manifest(1)),
            "upload/boto3": lambda: _plain_upload(client, "bench", f"plain{round_}", files, part, args.workers),
            "download/tierstate": lambda: tier.download(1, local),
            "download/boto3": lambda: _plain_download(
                client, "bench", f"plain{round_}", work / f"plain{round_}", part, args.workers
            ),
        }
        if have_dcp:
            runs["upload/dcp-fsspec"] = lambda: dcp.save(
                {"model": state},
                storage_writer=FsspecWriter(dcp_url, thread_count=args.workers, endpoint_url=endpoint),
            )
            runs["download/dcp-fsspec"] = lambda: dcp.load(
                into, storage_reader=FsspecReader(dcp_url, endpoint_url=endpoint)
            )
        for name in sorted(runs, key=lambda n: not n.startswith("upload")):  # uploads first: downloads read them
            times[name].append(_timed(runs[name]))
        for path in (work / f"restored{round_}", work / f"plain{round_}"):
            shutil.rmtree(path, ignore_errors=True)
        for prefix in (f"ts{round_}/", f"plain{round_}/", f"dcp{round_}/"):  # moto holds objects in memory
            for page in client.get_paginator("list_objects_v2").paginate(Bucket="bench", Prefix=prefix):
                keys = [{"Key": o["Key"]} for o in page.get("Contents", [])]
                if keys:
                    client.delete_objects(Bucket="bench", Delete={"Objects": keys})

    medians = {k: statistics.median(v) for k, v in times.items() if v}
    gbps = {k: nbytes / v / 1e9 for k, v in medians.items()}
    rows = [f"| {k} | {medians[k]:.3f} | {gbps[k]:.3f} |" for k in medians]
    ratios = {
        "upload tierstate / boto3": gbps["upload/tierstate"] / gbps["upload/boto3"],
        "download tierstate / boto3": gbps["download/tierstate"] / gbps["download/boto3"],
    }
    table = "\n".join(
        [f"{nbytes / MiB:.0f} MiB in {len(files)} files, {args.repeats} rounds, {args.workers} threads, "
         f"{args.part} MiB parts, moto on 127.0.0.1", "", "| method | median s | GB/s |", "|---|---|---|", *rows, ""]
        + [f"- {k}: {v:.0%}" for k, v in ratios.items()]
    )
    print(table)
    results = Path(args.results_dir)
    results.mkdir(parents=True, exist_ok=True)
    (results / "s3.json").write_text(json.dumps({"bytes": nbytes, "times": times, "ratios": ratios}, indent=1))
    (results / "s3.md").write_text(table + "\n")
    shutil.rmtree(work, ignore_errors=True)
    server.stop()


if __name__ == "__main__":
    main()
