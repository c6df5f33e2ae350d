"""Which remote failures are worth another try, and the one policy that decides how many.

:class:`RetryPolicy` is the remote tier's only retry loop (the clients' own are turned off
where they have a switch, so tries never multiply); :func:`is_transient` says which
backend errors it may try again.
"""

from __future__ import annotations

import errno
import logging
import random
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

from tiered_ckpt.errors import RemoteError

__all__ = ["RetryPolicy", "is_transient"]

logger = logging.getLogger("tiered_ckpt")
T = TypeVar("T")

_TRANSIENT_ERRNOS = {
    errno.EBUSY,  # s3fs: SlowDown, ServiceUnavailable
    errno.EAGAIN,
    errno.ETIMEDOUT,
    errno.ECONNRESET,
    errno.ECONNABORTED,
    errno.ECONNREFUSED,
    errno.EPIPE,
    getattr(errno, "EREMOTEIO", errno.EIO),  # s3fs: InternalError (HTTP 500)
}
_TRANSIENT_NAMES = (
    "Timeout",
    "ConnectionError",
    "ConnectionClosed",
    "ServerDisconnected",
    "ClientPayloadError",
    "ClientOSError",
    "EndpointConnectionError",
    "IncompleteRead",
    "RetryError",
    "ServiceUnavailable",
    "TransportError",
    "ServiceRequestError",  # azure-core: the request could not be sent (refused, reset, DNS)
    "ServiceResponseError",  # azure-core: the connection broke before the whole answer came
)
# HTTP statuses worth another try, for clients that raise them as a number rather than an
# errno or a message: gcsfs's HttpError (``code``, once its own tries are spent: a GCS 500 or
# 429 is "Backend Error, 500" / "...rate limit..., 429"), aiohttp's ClientResponseError (``status``),
# azure-core's HttpResponseError (``status_code``).
_TRANSIENT_STATUSES = {408, 429, 500, 502, 503, 504}
# Azure's error codes (``error_code``) of a request whose body did not arrive as sent: Blob
# Storage refuses a block whose bytes differ from the Content-MD5 (or CRC64) sent with it.
_TRANSIENT_CODES = {"Md5Mismatch", "Crc64Mismatch"}
_TRANSIENT_TEXT = (
    "SlowDown",
    "Service Unavailable",
    "503",
    "500 Internal",
    "Throttl",
    "Please reduce your request rate",
)


def is_transient(exc: BaseException) -> bool:
    """True if a request that failed with ``exc`` may succeed when tried again."""
    if isinstance(exc, (PermissionError, FileNotFoundError, FileExistsError, NotADirectoryError, IsADirectoryError)):
        return False
    if isinstance(exc, (TimeoutError, ConnectionError)):
        return True
    if isinstance(exc, OSError) and exc.errno in _TRANSIENT_ERRNOS:
        return True
    for name in ("status", "code", "status_code"):
        status = getattr(exc, name, None)
        if status is not None:
            break
    if isinstance(status, int) and not isinstance(status, bool) and status in _TRANSIENT_STATUSES:
        return True
    code = getattr(exc, "error_code", None)
    code = getattr(code, "value", code)  # the SDK's StorageErrorCode, a str enum, or the header's str
    if isinstance(code, str) and code in _TRANSIENT_CODES:
        return True
    names = [cls.__name__ for cls in type(exc).__mro__]
    if any(marker in name for name in names for marker in _TRANSIENT_NAMES):
        return True
    text = str(exc)
    return any(marker in text for marker in _TRANSIENT_TEXT)


@dataclass(frozen=True)
class RetryPolicy:
    """How often, and for how long, one remote operation is tried.

    An operation (a PUT and its confirmation, a listing, a download) is tried at most
    ``max_tries`` times; after a transient failure it waits a random time up to
    ``backoff_seconds * 2**(try-1)`` (at most ``max_backoff_seconds``), and it starts no
    new try once ``max_seconds`` have passed since the first. Each request gives up after
    ``timeout_seconds`` without an answer.
    """

    max_tries: int = 5
    backoff_seconds: float = 0.5
    max_backoff_seconds: float = 30.0
    max_seconds: float = 300.0
    timeout_seconds: float = 10.0

    def delay(self, attempt: int) -> float:
        """The random wait after failed try ``attempt`` (1, 2, ...): up to ``backoff_seconds *
        2**(attempt-1)``, at most ``max_backoff_seconds`` ("full jitter")."""
        return min(self.max_backoff_seconds, self.backoff_seconds * 2.0 ** min(attempt - 1, 64)) * random.random()

    def run(
        self,
        what: str,
        action: Callable[[], T],
        *,
        sleep: Callable[[float], None] = time.sleep,
        clock: Callable[[], float] = time.monotonic,
        deadline: float | None = None,
    ) -> T:
        """Return ``action()``, retrying a transient :class:`RemoteError` as this policy allows;
        no try starts after ``deadline`` (a time of ``clock``) either.

        The error finally raised carries ``tries``, the number of tries made.
        """
        started = clock()
        for attempt in range(1, self.max_tries + 1):
            try:
                return action()
            except RemoteError as exc:
                delay = self.delay(attempt)
                resumes = clock() + delay
                past_deadline = deadline is not None and resumes >= deadline
                out_of_time = resumes - started >= self.max_seconds or past_deadline
                if not exc.transient or exc.exhausted or attempt == self.max_tries or out_of_time:
                    exc.tries = max(attempt, exc.tries)  # tries made inside the action count too
                    exc.deadline = exc.deadline or (exc.transient and past_deadline)
                    raise
                logger.warning("%s: transient error (try %d of %d), retrying: %s", what, attempt, self.max_tries, exc)
                sleep(delay)
        raise AssertionError("unreachable")
