"""A real S3-protocol server for the s3 tier tests, and a real HTTP proxy in front of it that drops or
throttles chosen requests (moto cannot inject faults; a proxy on 127.0.0.1 is the network failing).

moto checks a conditional write's precondition (``If-Match``, ``If-None-Match: *``) and then writes,
two steps another request can fall between, where S3 checks and writes atomically. The server here is
given S3's semantics (:func:`_atomic_writes`: one lock around every write or delete of an object), and
can hold back the answer of one chosen request until another has been answered (:func:`held_answer`),
which is how the tests delay one writer's read without sleeping in the code under test.
"""

from __future__ import annotations

import http.client
import itertools
import os
import shutil
import socket
import subprocess
import tempfile
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

CREDENTIALS = {
    "AWS_ACCESS_KEY_ID": "tierstate-test",
    "AWS_SECRET_ACCESS_KEY": "tierstate-test-secret",
    "AWS_DEFAULT_REGION": "us-east-1",
    # Nothing from the machine's own AWS setup takes part: no profile file, no instance metadata.
    "AWS_SHARED_CREDENTIALS_FILE": os.devnull,
    "AWS_CONFIG_FILE": os.devnull,
    "AWS_EC2_METADATA_DISABLED": "true",
}


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class _Hold:
    """The answer of the first ``method`` request whose key ends in ``suffix``, held until a ``release``
    request (method, key suffix) has been answered with success (2xx)."""

    def __init__(self, method: str, suffix: str, release: tuple[str, str]) -> None:
        self.method, self.suffix, self.release = method, suffix, release
        self.taken = False
        self.holding = threading.Event()  # an answer is being held
        self.released = threading.Event()


_holds: list[_Hold] = []
_holds_lock = threading.Lock()
HOLD_LIMIT = 30.0  # a held answer goes out after this long even unreleased: a test fails, it never hangs


@contextmanager
def held_answer(method: str, suffix: str, release: tuple[str, str]) -> Iterator[_Hold]:
    """Hold the answer of the next ``method`` request for a key ending in ``suffix`` (computed when it
    arrives: what it reads is what was there then) until a request matching ``release`` (method, key suffix)
    has succeeded."""
    hold = _Hold(method, suffix, release)
    with _holds_lock:
        _holds.append(hold)
    try:
        yield hold
    finally:
        hold.released.set()
        with _holds_lock:
            _holds.remove(hold)


def _answered(method: str, path: str, answer: object) -> object:
    """Called by the server with every object request's answer before it goes out: a hold applies here."""
    mine = None
    succeeded = isinstance(answer, tuple) and isinstance(answer[0], int) and 200 <= answer[0] < 300
    with _holds_lock:
        for hold in _holds:
            if hold.taken and succeeded and hold.release[0] == method and path.endswith(hold.release[1]):
                hold.released.set()
            if mine is None and not hold.taken and hold.method == method and path.endswith(hold.suffix):
                hold.taken, mine = True, hold
    if mine is not None:
        mine.holding.set()
        mine.released.wait(HOLD_LIMIT)
    return answer


def _atomic_writes() -> None:
    """Give moto S3's atomic conditional writes: every write or delete of an object (a conditional one
    checks, then writes) runs under one lock, so no request falls between a check and its write. And
    route each object request's answer through :func:`_answered`. Idempotent."""
    from moto.s3.responses import S3Response

    if getattr(S3Response, "_tierstate_atomic", False):
        return
    lock = threading.RLock()

    def locked(method):
        def call(self, *args, **kwargs):
            with lock:
                return method(self, *args, **kwargs)

        return call

    for name in ("put_object", "delete_object", "_bucket_response_delete_keys", "_key_response_post"):
        setattr(S3Response, name, locked(getattr(S3Response, name)))
    key_response = S3Response.key_response

    def answered(self, request, full_url, headers):
        answer = key_response(self, request, full_url, headers)
        return _answered(request.method, full_url.split("?", 1)[0], answer)

    S3Response.key_response = answered
    S3Response._tierstate_atomic = True


@contextmanager
def moto_server() -> Iterator[str]:
    """moto's ThreadedMotoServer on a free port of 127.0.0.1, with S3's atomic conditional writes; its
    endpoint URL."""
    from moto.server import ThreadedMotoServer

    _atomic_writes()
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=_free_port(), verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    try:
        yield f"http://{host}:{port}"
    finally:
        server.stop()


@contextmanager
def minio_server(binary: str) -> Iterator[str]:
    """A MinIO server (``TIERSTATE_TEST_MINIO`` names its binary) on a free port, data in a temporary dir."""
    port = _free_port()
    data = tempfile.mkdtemp(prefix="tierstate-minio-")
    env = {
        **os.environ,
        "MINIO_ROOT_USER": CREDENTIALS["AWS_ACCESS_KEY_ID"],
        "MINIO_ROOT_PASSWORD": CREDENTIALS["AWS_SECRET_ACCESS_KEY"],
    }
    process = subprocess.Popen(
        [binary, "server", data, "--address", f"127.0.0.1:{port}"],
        env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + 30
        while True:  # readiness: the port answering its health check
            try:
                conn = http.client.HTTPConnection("127.0.0.1", port, timeout=1)
                conn.request("GET", "/minio/health/ready")
                if conn.getresponse().status == 200:
                    break
            except OSError:
                if time.monotonic() > deadline or process.poll() is not None:
                    raise RuntimeError(f"MinIO ({binary}) did not start") from None
                time.sleep(0.1)
        yield f"http://127.0.0.1:{port}"
    finally:
        process.terminate()
        process.wait(timeout=30)
        shutil.rmtree(data, ignore_errors=True)


# What the proxy answers for a fault: the status and the S3 error code.
_ERRORS = {"503": (503, "SlowDown"), "500": (500, "InternalError"), "403": (403, "AccessDenied")}


class FaultyProxy:
    """Forwards HTTP to ``upstream``; ``plan`` holds what to do to the next requests, one entry each:
    ``"drop"`` closes the connection without an answer, ``"503"`` answers 503 SlowDown, ``"pass"``
    forwards. Requests past the plan get ``failing`` (the server down for a while: any of those actions,
    ``"500"`` InternalError or ``"403"`` AccessDenied), or are forwarded while it is None. ``seen``
    counts the requests that arrived."""

    def __init__(self, upstream: str) -> None:
        self.upstream = upstream.removeprefix("http://")
        self.plan: list[str] = []
        self.failing: str | None = None
        self.seen = 0
        self._lock = threading.Lock()
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, format: str, *args: object) -> None:
                pass

            def _any(self) -> None:
                length = int(self.headers.get("Content-Length") or 0)
                body = self.rfile.read(length) if length else b""
                with proxy._lock:
                    proxy.seen += 1
                    action = proxy.plan.pop(0) if proxy.plan else proxy.failing or "pass"
                if action == "drop":
                    self.close_connection = True
                    self.connection.shutdown(socket.SHUT_RDWR)
                    return
                if action in _ERRORS:
                    status, code = _ERRORS[action]
                    answer = f"<Error><Code>{code}</Code><Message>{code} (s3server.py)</Message></Error>".encode()
                    self.send_response(status)
                    self.send_header("Content-Type", "application/xml")
                    self.send_header("Content-Length", str(len(answer)))
                    self.end_headers()
                    self.wfile.write(answer)
                    return
                conn = http.client.HTTPConnection(proxy.upstream, timeout=60)
                headers = {k: v for k, v in self.headers.items() if k.lower() != "connection"}
                conn.request(self.command, self.path, body=body, headers=headers)
                reply = conn.getresponse()
                data = reply.read()
                self.send_response(reply.status)
                for key, value in reply.getheaders():
                    if key.lower() not in ("content-length", "transfer-encoding", "connection", "server", "date"):
                        self.send_header(key, value)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)
                conn.close()

            do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = _any

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)
        self._thread.start()
        self.endpoint = f"http://127.0.0.1:{self._server.server_address[1]}"

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()


_SERVERS = ["moto"] + (["minio"] if os.environ.get("TIERSTATE_TEST_MINIO") else [])
_buckets = itertools.count()


@pytest.fixture(scope="session", params=_SERVERS)
def endpoint(request) -> Iterator[str]:
    saved = {k: os.environ.get(k) for k in CREDENTIALS}
    os.environ.update(CREDENTIALS)
    server = moto_server() if request.param == "moto" else minio_server(os.environ["TIERSTATE_TEST_MINIO"])
    with server as url:
        yield url
    for key, value in saved.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value


@pytest.fixture
def bucket(endpoint) -> str:
    import boto3

    name = f"tierstate-test-{os.getpid()}-{next(_buckets)}"
    boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1").create_bucket(Bucket=name)
    return name


