"""The S3 object-store layer under the ``kind: s3`` tier: one bucket prefix, spoken to with boto3.

Why boto3 and not obstore (DESIGN.md "Object storage"): the commit protocol and gc need calls
obstore does not offer (listing and aborting incomplete multipart uploads, a checksum algorithm per
part), and boto3 resolves credentials through the whole standard chain (environment, profiles, SSO,
instance roles) where obstore reads the environment only. Parallelism is ours: parts and ranges go
through a thread pool (boto3 clients are thread-safe and the work is I/O that releases the GIL).

boto3 is an optional extra (``tierstate[s3]``), imported when a store is built, never at import time.

Every failure is a :class:`~tiers.storage.filesystem.TierError` naming the tier and the ``s3://`` URL:
missing or refused credentials and a missing bucket are found by :meth:`ObjectStore.check` (a
runner calls it when it is built). Transient failures (connection drops, 5xx, 503 SlowDown,
throttling) are retried with exponential backoff by botocore's ``standard`` retry mode; a body that
breaks off mid-read is retried here, the same number of times.
"""

from __future__ import annotations

import errno
import os
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from datetime import datetime
from typing import Any, TypeVar

from . import faults
from .filesystem import CheckpointExistsError, TierError
from .s3url import URL_RE, endpoint_problem, s3_url_problem

T = TypeVar("T")
Progress = Callable[[int], None]

MiB = 1 << 20
#: S3 parts are 5 MiB at least (all but the last) and 10,000 at most; 16 MiB keeps a part's request
#: overhead under 1% at the bandwidths measured in benchmarks/s3.py and allows 160 GB files.
PART_SIZE = 16 * MiB
_MAX_PARTS = 10_000
_PRECONDITION_CODES = {"PreconditionFailed", "ConditionalRequestConflict"}
_MISSING_BUCKET_CODES = {"NoSuchBucket"}
_CREDENTIAL_CODES = {
    "InvalidAccessKeyId", "SignatureDoesNotMatch", "AccessDenied", "InvalidToken", "ExpiredToken", "403",
}


class ObjectMissingError(TierError, FileNotFoundError):
    """No object of that name (or no bucket): a FileNotFoundError, as a missing file is."""


class ObjectChangedError(TierError):
    """A conditional write or delete (``If-Match``) found the object replaced: another writer got there first."""


@dataclass(frozen=True)
class S3Url:
    bucket: str
    prefix: str  # no leading or trailing slash; "" is the bucket's root

    def __str__(self) -> str:
        return f"s3://{self.bucket}/{self.prefix}" if self.prefix else f"s3://{self.bucket}"


def parse_s3_url(url: str) -> S3Url:
    """``s3://bucket[/prefix]``; ValueError (a TierstateError) naming the URL if it is not one."""
    problem = s3_url_problem(url)
    match = URL_RE.match(url)
    if problem is not None or match is None:
        raise TierError(errno.EINVAL, f"not an s3:// URL: {problem}")
    return S3Url(match.group(1), (match.group(2) or "").strip("/"))


@dataclass(frozen=True)
class StoredObject:
    name: str  # the key below the store's prefix
    size: int
    modified: datetime
    etag: str = ""  # the server's digest of its bytes: any rewrite changes it (unless the bytes are the same)


@dataclass(frozen=True)
class Upload:
    """A multipart upload begun and never completed or aborted (a killed writer leaves one)."""

    name: str
    upload_id: str
    last_active: datetime  # when it began or last received a part: a slow upload at work is not garbage


def _boto3() -> Any:  # boto3 has no type stubs installed
    try:
        import boto3
    except ImportError:
        raise TierError(
            errno.ENOPKG, "an s3 tier needs boto3: pip install 'tierstate[s3]'"
        ) from None
    return boto3


def _error_code(exc: BaseException) -> str:
    response = getattr(exc, "response", None)
    if isinstance(response, dict):
        error = response.get("Error", {})
        code = str(error.get("Code", ""))
        return code or str(response.get("ResponseMetadata", {}).get("HTTPStatusCode", ""))
    return ""


class ObjectStore:
    """One ``s3://bucket/prefix`` of one tier; names passed in are relative to the prefix."""

    def __init__(
        self,
        tier: str,
        url: str,
        *,
        endpoint_url: str | None = None,
        region: str | None = None,
        retries: int = 5,
        workers: int = 8,
        part_size: int = PART_SIZE,
        timeout: float = 60.0,
    ) -> None:
        self.tier = tier
        self.url = parse_s3_url(url)
        # botocore takes $AWS_ENDPOINT_URL_S3, else $AWS_ENDPOINT_URL, when none is given: checked too.
        variable = next((key for key in ("AWS_ENDPOINT_URL_S3", "AWS_ENDPOINT_URL") if os.environ.get(key)), "")
        setting = "endpoint_url" if endpoint_url else f"${variable}"
        endpoint = endpoint_url or os.environ.get(variable)
        problem = endpoint_problem(endpoint) if endpoint else None
        if problem is not None:
            raise TierError(errno.EINVAL, f"tier {tier}: {setting} {problem}")
        self.retries = retries
        self.workers = max(1, workers)
        self.part_size = max(5 * MiB, part_size)
        boto3 = _boto3()
        from botocore.config import Config

        config = Config(
            retries={"max_attempts": retries + 1, "mode": "standard"},
            connect_timeout=timeout,
            read_timeout=timeout,  # a server that stops answering fails the call instead of hanging it
            max_pool_connections=self.workers * 2,
            request_checksum_calculation="when_supported",
        )
        session = boto3.session.Session()
        self._client = session.client("s3", endpoint_url=endpoint_url, region_name=region, config=config)

    # -- names and errors ---------------------------------------------------------------------
    def key(self, name: str) -> str:
        return f"{self.url.prefix}/{name}" if self.url.prefix else name

    def where(self, name: str = "") -> str:
        return f"{self.url}/{name}" if name else str(self.url)

    def _fail(self, exc: BaseException, doing: str, name: str = "") -> TierError:
        """The TierError for ``exc``: what was being done, on which tier and URL, and what to fix."""
        code = _error_code(exc)
        kind = type(exc).__name__
        if kind in ("NoCredentialsError", "PartialCredentialsError"):
            return TierError(
                errno.EACCES,
                f"tier {self.tier}: no S3 credentials found for {self.where(name)} (set AWS_ACCESS_KEY_ID and "
                f"AWS_SECRET_ACCESS_KEY, or AWS_PROFILE; credentials never go in the YAML)",
            )
        if code in _MISSING_BUCKET_CODES or (code in ("404", "NotFound") and doing == "check the bucket"):
            return ObjectMissingError(
                errno.ENOENT, f"tier {self.tier}: bucket {self.url.bucket!r} does not exist ({self.url})"
            )
        if code in _CREDENTIAL_CODES:
            return TierError(
                errno.EACCES,
                f"tier {self.tier}: the S3 credentials were refused ({code}) to {doing} {self.where(name)}",
            )
        if code in ("NoSuchKey", "404", "NotFound"):
            return ObjectMissingError(errno.ENOENT, f"tier {self.tier}: {self.where(name)} does not exist")
        return TierError(errno.EIO, f"tier {self.tier}: cannot {doing} {self.where(name)}: {code or kind}: {exc}")

    def _call(self, doing: str, name: str, fn: Callable[[], T]) -> T:
        """``fn`` with botocore's errors as TierErrors; a body read cut off mid-way is retried with
        backoff (botocore retries the request, not the reading of its body)."""
        from botocore.exceptions import BotoCoreError, ClientError

        transient = _transient_errors()
        for attempt in range(self.retries + 1):
            try:
                return fn()
            except transient as exc:
                if attempt == self.retries:
                    raise self._fail(exc, doing, name) from exc
                time.sleep(min(20.0, 0.1 * 2**attempt))
            except (ClientError, BotoCoreError) as exc:
                raise self._fail(exc, doing, name) from exc
        raise AssertionError("unreachable")

    # -- checks -------------------------------------------------------------------------------
    def check(self) -> None:
        """Fail now, naming the tier, if credentials are missing or refused or the bucket is missing."""
        self._call("check the bucket", "", lambda: self._client.head_bucket(Bucket=self.url.bucket))
        self.list("")  # head_bucket may pass with credentials that cannot list; a listing is what reads need

    # -- writes -------------------------------------------------------------------------------
    def put_bytes(self, name: str, data: bytes, *, if_absent: bool = False, if_match: str | None = None) -> str:
        """One object; its ETag. ``if_absent`` is the conditional put ``If-None-Match: *``:
        CheckpointExistsError if the name exists, so of two writers exactly one publishes. ``if_match``
        replaces the object only while its ETag is that one (S3 checks and writes atomically):
        ObjectChangedError if another writer replaced it meanwhile, ObjectMissingError if it is gone."""
        extra: dict[str, str] = {"IfNoneMatch": "*"} if if_absent else {}
        if if_match is not None:
            extra["IfMatch"] = if_match
        from botocore.exceptions import ClientError

        try:
            answer = self._call(
                "write",
                name,
                lambda: self._client.put_object(
                    Bucket=self.url.bucket, Key=self.key(name), Body=data, ChecksumAlgorithm="CRC32", **extra
                ),
            )
        except TierError as exc:
            cause = exc.__cause__
            if isinstance(cause, ClientError) and _error_code(cause) in _PRECONDITION_CODES:
                if if_absent:
                    raise CheckpointExistsError(
                        errno.EEXIST,
                        f"tier {self.tier}: {self.where(name)} already exists (another writer published it)",
                    ) from None
                if if_match is not None:
                    raise self._changed(name) from None
            raise
        return str(answer["ETag"])

    def _changed(self, name: str) -> ObjectChangedError:
        return ObjectChangedError(errno.EBUSY, f"tier {self.tier}: {self.where(name)} was replaced by another writer")

    def put_file(self, name: str, fd: int, size: int, progress: Progress | None = None) -> str:
        """The first ``size`` bytes of open file ``fd`` as one object, its ETag: multipart when larger than a
        part, its parts uploaded in parallel, each with its CRC32 checked by the server. A failed upload is
        aborted; one cut short by a kill is left for gc (:meth:`uploads`). Fault point ``s3.part`` is
        reached after each part is uploaded, ``s3.object`` after an object put whole."""
        advance = progress or (lambda _n: None)
        if size <= self.part_size:
            etag = self.put_bytes(name, os.pread(fd, size, 0) if size else b"")
            advance(size)
            faults.point("s3.object")  # TIERSTATE_FAULT=s3.object@N: SIGKILL between the objects of a step
            return etag
        part_size = max(self.part_size, -(-size // _MAX_PARTS))
        key = self.key(name)
        created = self._call(
            "start a multipart upload of",
            name,
            lambda: self._client.create_multipart_upload(Bucket=self.url.bucket, Key=key, ChecksumAlgorithm="CRC32"),
        )
        upload_id = created["UploadId"]

        def part(number: int) -> dict[str, Any]:
            offset = (number - 1) * part_size
            body = os.pread(fd, min(part_size, size - offset), offset)
            sent = self._call(
                f"upload part {number} of",
                name,
                lambda: self._client.upload_part(
                    Bucket=self.url.bucket, Key=key, UploadId=upload_id, PartNumber=number,
                    Body=body, ChecksumAlgorithm="CRC32",
                ),
            )
            advance(len(body))
            faults.point("s3.part")  # TIERSTATE_FAULT=s3.part@N: SIGKILL mid-upload, for the gc tests
            return {"PartNumber": number, "ETag": sent["ETag"], "ChecksumCRC32": sent["ChecksumCRC32"]}

        try:
            with ThreadPoolExecutor(self.workers, thread_name_prefix="tierstate-s3-put") as pool:
                parts = list(pool.map(part, range(1, -(-size // part_size) + 1)))
            completed = self._call(
                "complete the multipart upload of",
                name,
                lambda: self._client.complete_multipart_upload(
                    Bucket=self.url.bucket, Key=key, UploadId=upload_id, MultipartUpload={"Parts": parts}
                ),
            )
        except BaseException:
            self.abort_upload(Upload(name, upload_id, datetime.now()))
            raise
        return str(completed["ETag"])

    def delete_if(self, name: str, etag: str) -> bool:
        """Delete ``name`` only while its ETag is ``etag`` (``If-Match``: S3 checks and deletes atomically);
        whether it was deleted (False: another writer replaced or removed it, and it is theirs now)."""
        from botocore.exceptions import ClientError

        try:
            self._call(
                "delete",
                name,
                lambda: self._client.delete_object(Bucket=self.url.bucket, Key=self.key(name), IfMatch=etag),
            )
        except ObjectMissingError:
            return False
        except TierError as exc:
            cause = exc.__cause__
            if isinstance(cause, ClientError) and _error_code(cause) in _PRECONDITION_CODES:
                return False
            raise
        return True

    def delete(self, names: list[str]) -> None:
        for start in range(0, len(names), 1000):  # DeleteObjects takes 1,000 keys a request
            batch = [{"Key": self.key(n)} for n in names[start : start + 1000]]
            answer = self._call(
                "delete objects under",
                "",
                lambda batch=batch: self._client.delete_objects(
                    Bucket=self.url.bucket, Delete={"Objects": batch, "Quiet": True}
                ),
            )
            failed = answer.get("Errors", [])
            if failed:
                raise TierError(
                    errno.EIO, f"tier {self.tier}: cannot delete {self.where(failed[0]['Key'])}: {failed[0]['Code']}"
                )

    # -- reads --------------------------------------------------------------------------------
    def get_range(self, name: str, offset: int, length: int) -> bytes:
        """``length`` bytes at ``offset`` of one object; TierError if fewer come back."""
        if length == 0:
            return b""

        def read() -> bytes:
            answer = self._client.get_object(
                Bucket=self.url.bucket, Key=self.key(name), Range=f"bytes={offset}-{offset + length - 1}"
            )
            return answer["Body"].read()

        data = self._call("read", name, read)
        if len(data) != length:
            raise TierError(
                errno.EIO, f"tier {self.tier}: {self.where(name)} gave {len(data)} of {length} bytes at offset {offset}"
            )
        return data

    def get_bytes(self, name: str) -> bytes:
        return self.get_versioned(name)[0]

    def get_versioned(self, name: str) -> tuple[bytes, str]:
        """A whole object and its ETag, as one answer (so a conditional write can name what was read)."""

        def read() -> tuple[bytes, str]:
            answer = self._client.get_object(Bucket=self.url.bucket, Key=self.key(name))
            return answer["Body"].read(), str(answer["ETag"])

        return self._call("read", name, read)

    def get_file(self, name: str, fd: int, size: int, progress: Progress | None = None) -> None:
        """The whole object into open file ``fd`` by parallel ranged GETs, each written at its offset."""
        advance = progress or (lambda _n: None)
        os.ftruncate(fd, size)

        def chunk(offset: int) -> None:
            data = self.get_range(name, offset, min(self.part_size, size - offset))
            os.pwrite(fd, data, offset)
            advance(len(data))

        with ThreadPoolExecutor(self.workers, thread_name_prefix="tierstate-s3-get") as pool:
            list(pool.map(chunk, range(0, size, self.part_size)))

    def list(self, under: str) -> list[StoredObject]:
        """Every object whose name starts with ``under`` (names relative to the prefix)."""
        strip = len(self.key(""))
        found: list[StoredObject] = []

        def pages() -> Iterator[dict[str, Any]]:
            paginator = self._client.get_paginator("list_objects_v2")
            return iter(paginator.paginate(Bucket=self.url.bucket, Prefix=self.key(under)))

        for page in self._call("list", under, lambda: list(pages())):
            for obj in page.get("Contents", []):
                found.append(StoredObject(obj["Key"][strip:], int(obj["Size"]), obj["LastModified"], obj["ETag"]))
        return found

    def uploads(self) -> list[Upload]:
        """Multipart uploads under the prefix never completed nor aborted, each with its last activity."""
        strip = len(self.key(""))

        def pages() -> list[dict[str, Any]]:
            paginator = self._client.get_paginator("list_multipart_uploads")
            return list(paginator.paginate(Bucket=self.url.bucket, Prefix=self.key("")))

        found: list[Upload] = []
        for page in self._call("list the multipart uploads under", "", pages):
            for u in page.get("Uploads", []):
                name = u["Key"][strip:]
                parts = self._call(
                    "list the uploaded parts of",
                    name,
                    lambda u=u: self._client.list_parts(Bucket=self.url.bucket, Key=u["Key"], UploadId=u["UploadId"]),
                )
                last = max([u["Initiated"], *(p["LastModified"] for p in parts.get("Parts", []))])
                found.append(Upload(name, u["UploadId"], last))
        return found

    def abort_upload(self, upload: Upload) -> None:
        self._call(
            "abort the multipart upload of",
            upload.name,
            lambda: self._client.abort_multipart_upload(
                Bucket=self.url.bucket, Key=self.key(upload.name), UploadId=upload.upload_id
            ),
        )


def _transient_errors() -> tuple[type[BaseException], ...]:
    """Errors of reading a response body that a retry can cure (the request itself botocore retries)."""
    from botocore.exceptions import ConnectionClosedError, IncompleteReadError, ReadTimeoutError, ResponseStreamingError
    from urllib3.exceptions import ProtocolError

    return (ResponseStreamingError, IncompleteReadError, ConnectionClosedError, ReadTimeoutError, ProtocolError)
