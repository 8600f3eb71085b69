"""What an ``s3://`` URL and an S3 endpoint must look like, said in words.

Apart from the object store (tiers/storage/objstore.py), which imports boto3 and the tier machinery, so that the
config loader checks ``tiers.NAME.url`` and ``tiers.NAME.endpoint_url`` by the same rule without loading
either (nor torch): a config is read in a blink, ``tierstate --help`` too.
"""

from __future__ import annotations

import re
from urllib.parse import urlsplit

URL_RE = re.compile(r"^s3://([a-z0-9][a-z0-9.\-]{1,61}[a-z0-9])(?:/(.*))?$")
"""``s3://bucket[/prefix]``: the bucket (group 1) as S3 names them, the prefix (group 2) as given."""


def s3_url_problem(url: str) -> str | None:
    """What is wrong with ``url`` as ``s3://bucket[/prefix]``, said for a person (an example, no pattern);
    None if nothing is. The config's ``url`` and ``--tier NAME=s3://...`` are checked by this one rule."""
    match = URL_RE.match(url)
    if match is None:
        return (
            "must be s3://BUCKET/PREFIX, e.g. s3://my-bucket/run7/ckpt: the bucket 3 to 63 lower-case letters, "
            f"digits, dots and hyphens; got {url!r}"
        )
    prefix = (match.group(2) or "").strip("/")
    if prefix and any(part in ("", ".", "..") for part in prefix.split("/")):
        return f"a prefix has no empty, '.' or '..' segments; got {url!r}"
    return None


def endpoint_problem(url: str) -> str | None:
    """What is wrong with ``url`` as an S3 endpoint, for a person; None if nothing is. Checked before
    botocore, whose ``ValueError: Invalid endpoint`` names neither the tier nor the setting."""
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.netloc:
        return f"must be a URL with its scheme, e.g. http://127.0.0.1:9000 or https://s3.example.com; got {url!r}"
    return None
