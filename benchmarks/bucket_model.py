"""A bucket that behaves like one: an HTTP proxy in front of moto's S3 server, in a process of its own.

Run as ``python -m benchmarks.bucket_model UPSTREAM '{"scale": 10, "rate_limit": true, "rate_share": 1}'`` by
:func:`benchmarks.harness.modelled_bucket`; prints one JSON line once it listens (its
``endpoint``, ``http://127.0.0.1:PORT``, and the ``model`` it runs), serves until its
standard input closes, then prints the requests it ``refused``. moto on
loopback answers at once and as fast as its process runs; S3 does not:

- **Bandwidth per connection**: each connection's request and response bodies pass at
  ``bandwidth`` bytes a second at most (S3 serves about 85-90 MB/s a connection: AWS's
  performance guidelines reach 100 Gb/s with about 140 connections).
- **Time to the first byte**: each answer starts ``latency`` seconds after its request has
  arrived whole, or when moto answers, whichever is later (tens of ms on S3).
- **503 SlowDown per key prefix**: past ``writes`` PUT/POST/DELETE or ``reads`` GET/HEAD
  requests a second under one prefix (S3: about 3,500 and 5,500 per partitioned prefix), a
  request is answered ``503 SlowDown`` at once, as S3 does. A prefix is the key up to its last
  ``/`` (the step's directory), each with a bucket of one second's requests that refills at
  the rate.

:class:`BucketModel` holds the figures; :meth:`BucketModel.scaled` divides S3's by a factor
so that a bucket fits this machine (see its doc). The pacing and the rate limit are here
because no library of the Python world models a store's limits; a proxy sees exactly what a
client sends, so both this library's client and boto3's meet the same bucket.
"""

from __future__ import annotations

import dataclasses
import http.client
import http.server
import json
import sys
import threading
import time
import urllib.parse
from collections.abc import Callable
from dataclasses import dataclass

from benchmarks.harness import S3_FIGURES

__all__ = ["S3", "BucketModel", "Pacer", "PrefixLimiter", "main"]

CHUNK = 64 << 10
WRITES = frozenset({"PUT", "POST", "DELETE"})


@dataclass(frozen=True)
class BucketModel:
    """A bucket's limits: ``bandwidth`` (bytes a second a connection), ``latency`` (seconds to the
    first byte of an answer), ``writes`` and ``reads`` (requests a second a key prefix, None: no limit)."""

    bandwidth: float
    latency: float
    writes: float | None
    reads: float | None

    def scaled(self, factor: float) -> BucketModel:
        """This bucket with its clock slowed ``factor`` times: bandwidth and request rates divided
        by it, latency multiplied. Every transfer then takes ``factor`` times as long, and their
        proportions (a part's time against the first byte's, requests against bytes) stay S3's.
        With a factor of 10, a connection carries 8.5 MB/s: ten of them stay within what moto
        serves on two cores (about 0.16 GB/s), so the model, not moto, bounds each one."""
        return BucketModel(
            self.bandwidth / factor,
            self.latency * factor,
            None if self.writes is None else self.writes / factor,
            None if self.reads is None else self.reads / factor,
        )

    def sharing(self, share: float) -> BucketModel:
        """This bucket with ``share`` of its request rates left: what a job's few ranks meet of a
        prefix the job's other ranks use too."""
        return dataclasses.replace(
            self,
            writes=None if self.writes is None else self.writes * share,
            reads=None if self.reads is None else self.reads * share,
        )

    def without_rate_limit(self) -> BucketModel:
        """This bucket, never answering 503 SlowDown."""
        return dataclasses.replace(self, writes=None, reads=None)


S3 = BucketModel(**S3_FIGURES)
"""S3's published figures (:data:`benchmarks.harness.S3_FIGURES`)."""


class Pacer:
    """Holds one connection's bytes to ``rate`` a second: :meth:`passed` after each piece sleeps
    until the bytes so far could have passed at the rate since the pacer started."""

    def __init__(
        self,
        rate: float,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        self.rate, self._clock, self._sleep = rate, clock, sleep
        self._start = clock()
        self._bytes = 0

    def passed(self, count: int) -> None:
        self._bytes += count
        due = self._start + self._bytes / self.rate
        wait = due - self._clock()
        if wait > 0:
            self._sleep(wait)


class PrefixLimiter:
    """Requests a second a key prefix, writes and reads apart: a bucket of one second's requests
    (at least one) per prefix and kind, refilled at the rate; :meth:`admit` False for a request past it."""

    def __init__(self, model: BucketModel, clock: Callable[[], float] = time.monotonic) -> None:
        self._rates = {True: model.writes, False: model.reads}
        self._clock = clock
        self._tokens: dict[tuple[bool, str], tuple[float, float]] = {}  # (write, prefix): (tokens, when)
        self._lock = threading.Lock()
        self.refused = 0

    def admit(self, method: str, path: str) -> bool:
        write = method in WRITES
        rate = self._rates[write]
        if rate is None:
            return True
        key = (write, prefix_of(path))
        with self._lock:
            now = self._clock()
            burst = max(rate, 1.0)  # a second's requests, and at least one
            tokens, then = self._tokens.get(key, (burst, now))
            tokens = min(burst, tokens + (now - then) * rate)
            if tokens < 1:
                self._tokens[key] = (tokens, now)
                self.refused += 1
                return False
            self._tokens[key] = (tokens - 1, now)
            return True


def prefix_of(path: str) -> str:
    """The key prefix of a request's path (``/bucket/run/step-1/rank-0`` -> ``/bucket/run/step-1``;
    a bucket's own requests, a listing: the bucket)."""
    key = urllib.parse.urlsplit(path).path
    head, _, _ = key.rstrip("/").rpartition("/")
    return head or key


_SLOW_DOWN = b"<Error><Code>SlowDown</Code><Message>Please reduce your request rate.</Message></Error>"
_HOP = frozenset({"connection", "keep-alive", "proxy-connection", "transfer-encoding", "content-length"})


def serve(upstream: str, model: BucketModel) -> http.server.ThreadingHTTPServer:
    """The proxy of ``model`` in front of ``upstream``, listening on a free loopback port (not yet serving)."""
    target = urllib.parse.urlsplit(upstream)
    limiter = PrefixLimiter(model)

    class Handler(http.server.BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args: object) -> None:
            pass

        def _handle(self) -> None:
            if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
                self.send_error(501, "the bucket model takes bodies with a Content-Length only")
                return
            pacer = Pacer(model.bandwidth)
            admitted = limiter.admit(self.command, self.path)
            length = int(self.headers.get("Content-Length") or 0)
            body = bytearray()
            while len(body) < length:  # the request's bytes, at the connection's bandwidth
                piece = self.rfile.read(min(CHUNK, length - len(body)))
                if not piece:
                    return
                body += piece
                if admitted:
                    pacer.passed(len(piece))
            arrived = time.monotonic()
            if not admitted:
                self.send_response(503, "Slow Down")
                self.send_header("Content-Type", "application/xml")
                self.send_header("Content-Length", str(len(_SLOW_DOWN)))
                self.end_headers()
                if self.command != "HEAD":
                    self.wfile.write(_SLOW_DOWN)
                return
            connection = http.client.HTTPConnection(target.hostname, target.port, timeout=600)
            try:
                connection.putrequest(self.command, self.path, skip_host=True, skip_accept_encoding=True)
                for name, value in self.headers.items():
                    if name.lower() not in _HOP:
                        connection.putheader(name, value)
                connection.putheader("Content-Length", str(len(body)))
                connection.endheaders(bytes(body))
                response = connection.getresponse()
                data = response.read()
            finally:
                connection.close()
            wait = arrived + model.latency - time.monotonic()
            if wait > 0:
                time.sleep(wait)
            self.send_response(response.status, response.reason)
            for name, value in response.getheaders():
                if name.lower() not in _HOP:
                    self.send_header(name, value)
            # A HEAD answer carries the object's length, not that of its (empty) body.
            size = response.getheader("Content-Length") if self.command == "HEAD" else str(len(data))
            self.send_header("Content-Length", size or "0")
            self.end_headers()
            if self.command == "HEAD":
                return
            pacer = Pacer(model.bandwidth)
            for start in range(0, len(data), CHUNK):  # the answer's bytes, at the connection's bandwidth
                self.wfile.write(data[start : start + CHUNK])
                pacer.passed(min(CHUNK, len(data) - start))

        do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = _handle

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    server.daemon_threads = True
    server.limiter = limiter  # type: ignore[attr-defined]
    return server


def main(argv: list[str] | None = None) -> None:
    """Serve S3's figures slowed as told until standard input closes (see the module doc)."""
    upstream, document = argv if argv is not None else sys.argv[1:]
    told = json.loads(document)
    model = S3.scaled(float(told["scale"])).sharing(float(told["rate_share"]))
    if not told["rate_limit"]:
        model = model.without_rate_limit()
    server = serve(upstream, model)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    endpoint = f"http://127.0.0.1:{server.server_address[1]}"
    print(json.dumps({"endpoint": endpoint, "model": dataclasses.asdict(model)}), flush=True)
    sys.stdin.read()  # the parent closes it to stop the bucket
    server.shutdown()
    print(json.dumps({"refused": server.limiter.refused}), flush=True)  # type: ignore[attr-defined]


if __name__ == "__main__":
    main()
