"""RetryPolicy (tries, capped full-jitter backoff, deadlines) and is_transient on the clients' real exceptions."""

import errno
import logging
import random
import time

import aiohttp
import botocore.exceptions
import gcsfs.retry
import pytest
import requests
import s3fs.errors
from hypothesis import given
from hypothesis import strategies as st
from multidict import CIMultiDict, CIMultiDictProxy
from yarl import URL

from tiered_ckpt.errors import RemoteError
from tiered_ckpt.tiers.remote.requests import Requests
from tiered_ckpt.tiers.remote.retry import RetryPolicy, is_transient


class FakeTime:
    """A clock that moves only when the policy sleeps (no wall clock in these tests)."""

    def __init__(self, start=1000.0):
        self.now = start
        self.sleeps = []

    def clock(self):
        return self.now

    def sleep(self, seconds):
        self.sleeps.append(seconds)
        self.now += seconds


class Failing:
    """An action that raises ``errors`` in turn, then returns ``value``; counts its calls."""

    def __init__(self, errors, value="done"):
        self.errors = list(errors)
        self.value = value
        self.calls = 0

    def __call__(self):
        self.calls += 1
        if self.errors:
            raise self.errors.pop(0)
        return self.value


def transient(message="SlowDown"):
    return RemoteError(message, transient=True)


def run(policy, action, time=None, **kwargs):
    time = time or FakeTime()
    return policy.run("put s3://b/k", action, sleep=time.sleep, clock=time.clock, **kwargs)


# -- tries ------------------------------------------------------------------------------


def test_transient_failures_are_tried_again_until_the_action_succeeds(caplog):
    time = FakeTime()
    action = Failing([transient(), transient()])
    with caplog.at_level(logging.WARNING, logger="tiered_ckpt"):
        assert run(RetryPolicy(max_tries=5), action, time) == "done"
    assert action.calls == 3 and len(time.sleeps) == 2
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert [r.getMessage().split(": transient")[0] for r in warnings] == ["put s3://b/k"] * 2
    assert "try 1 of 5" in warnings[0].getMessage() and "try 2 of 5" in warnings[1].getMessage()


def test_the_error_after_the_last_try_says_how_many_tries_were_made():
    time = FakeTime()
    action = Failing([transient() for _ in range(10)])
    with pytest.raises(RemoteError) as caught:
        run(RetryPolicy(max_tries=4), action, time)
    assert action.calls == 4 and caught.value.tries == 4
    assert len(time.sleeps) == 3  # no wait after the last try
    assert caught.value.deadline is False


def test_a_permanent_error_is_raised_at_once():
    time = FakeTime()
    action = Failing([RemoteError("AccessDenied", transient=False)])
    with pytest.raises(RemoteError, match="AccessDenied") as caught:
        run(RetryPolicy(max_tries=5), action, time)
    assert action.calls == 1 and caught.value.tries == 1 and time.sleeps == []


def test_an_error_whose_tries_a_lower_layer_spent_is_not_tried_again():
    spent = transient()
    spent.exhausted, spent.tries = True, 7
    action = Failing([spent])
    with pytest.raises(RemoteError) as caught:
        run(RetryPolicy(max_tries=5), action)
    assert action.calls == 1
    assert caught.value.tries == 7  # the tries made inside the action are kept, not replaced by 1


def test_an_error_that_is_not_a_remote_error_is_not_retried():
    action = Failing([ValueError("a bug, not the store")])
    with pytest.raises(ValueError):
        run(RetryPolicy(max_tries=5), action)
    assert action.calls == 1


# -- backoff ------------------------------------------------------------------------------


@given(
    attempt=st.integers(1, 10_000),
    backoff=st.floats(0, 100, allow_nan=False),
    cap=st.floats(0, 1000, allow_nan=False),
    seed=st.integers(0, 2**32 - 1),
)
def test_each_wait_is_between_zero_and_the_capped_exponential(attempt, backoff, cap, seed):
    random.seed(seed)
    policy = RetryPolicy(backoff_seconds=backoff, max_backoff_seconds=cap)
    delay = policy.delay(attempt)
    assert 0 <= delay <= min(cap, backoff * 2.0 ** min(attempt - 1, 1000))


def test_the_waits_grow_exponentially_up_to_the_cap(monkeypatch):
    monkeypatch.setattr(random, "random", lambda: 1.0)  # the top of each jitter range
    policy = RetryPolicy(backoff_seconds=0.5, max_backoff_seconds=3.0)
    assert [policy.delay(attempt) for attempt in range(1, 6)] == [0.5, 1.0, 2.0, 3.0, 3.0]
    assert policy.delay(10**9) == 3.0  # no overflow however many tries
    monkeypatch.setattr(random, "random", lambda: 0.25)
    assert policy.delay(3) == 0.5  # a quarter of 2.0: the wait is scaled, not fixed


def test_the_waits_are_jittered_not_fixed():
    random.seed(1234)
    policy = RetryPolicy(backoff_seconds=1.0, max_backoff_seconds=100.0)
    waits = {policy.delay(4) for _ in range(20)}
    assert len(waits) == 20 and all(0 <= wait <= 8.0 for wait in waits)


def test_the_policy_sleeps_the_waits_it_computes(monkeypatch):
    monkeypatch.setattr(random, "random", lambda: 1.0)
    time = FakeTime()
    run(RetryPolicy(max_tries=5, backoff_seconds=0.5, max_backoff_seconds=1.5), Failing([transient()] * 4), time)
    assert time.sleeps == [0.5, 1.0, 1.5, 1.5]


# -- deadlines ------------------------------------------------------------------------------


def test_no_try_starts_once_max_seconds_have_passed_since_the_first(monkeypatch):
    monkeypatch.setattr(random, "random", lambda: 1.0)
    time = FakeTime()
    action = Failing([transient() for _ in range(100)])
    policy = RetryPolicy(max_tries=100, backoff_seconds=10.0, max_backoff_seconds=10.0, max_seconds=35.0)
    with pytest.raises(RemoteError) as caught:
        run(policy, action, time)
    # tries at 0, 10, 20, 30 s; the next would start at 40 s, past 35
    assert action.calls == 4 and caught.value.tries == 4 and sum(time.sleeps) == 30.0
    assert caught.value.deadline is False  # max_seconds is not the caller's deadline


def test_no_try_starts_after_the_callers_deadline_and_the_error_says_so(monkeypatch):
    monkeypatch.setattr(random, "random", lambda: 1.0)
    time = FakeTime(start=1000.0)
    action = Failing([transient() for _ in range(100)])
    policy = RetryPolicy(max_tries=100, backoff_seconds=4.0, max_backoff_seconds=4.0)
    with pytest.raises(RemoteError) as caught:
        run(policy, action, time, deadline=1010.0)
    assert action.calls == 3 and time.now == 1008.0  # the try at 1012 would start past the deadline
    assert caught.value.deadline is True


def test_a_deadline_already_past_still_allows_the_first_try():
    time = FakeTime(start=1000.0)
    action = Failing([transient(), transient()])
    with pytest.raises(RemoteError) as caught:
        run(RetryPolicy(max_tries=5), action, time, deadline=999.0)
    assert action.calls == 1 and caught.value.deadline is True and time.sleeps == []


def test_a_permanent_error_near_the_deadline_is_not_called_a_deadline():
    time = FakeTime(start=1000.0)
    with pytest.raises(RemoteError) as caught:
        run(RetryPolicy(), Failing([RemoteError("NoSuchBucket", transient=False)]), time, deadline=1000.0)
    assert caught.value.deadline is False


# -- is_transient on the clients' own exceptions ----------------------------------------------


def client_error(code, message, status):
    return botocore.exceptions.ClientError(
        {"Error": {"Code": code, "Message": message}, "ResponseMetadata": {"HTTPStatusCode": status}}, "PutObject"
    )


@pytest.mark.parametrize(
    "code, message, status, expected",
    [
        ("SlowDown", "Please reduce your request rate.", 503, True),
        ("ServiceUnavailable", "Service is unable to handle request.", 503, True),
        ("InternalError", "We encountered an internal error. Please try again.", 500, True),
        ("OperationAborted", "A conflicting conditional operation is in progress", 409, True),
        ("AccessDenied", "Access Denied", 403, False),
        ("NoSuchBucket", "The specified bucket does not exist", 404, False),
        ("NoSuchKey", "The specified key does not exist.", 404, False),
        ("InvalidArgument", "Invalid argument", 400, False),
    ],
)
def test_s3_errors_as_s3fs_raises_them(code, message, status, expected):
    error = s3fs.errors.translate_boto_error(client_error(code, message, status))
    assert is_transient(error) is expected


def test_a_throttling_client_error_is_transient_and_access_denied_is_not():
    assert is_transient(client_error("ThrottlingException", "Rate exceeded", 400))  # "Throttl"
    assert not is_transient(client_error("AccessDenied", "Access Denied", 403))


@pytest.mark.parametrize(
    "error",
    [
        botocore.exceptions.EndpointConnectionError(endpoint_url="http://127.0.0.1:1"),
        botocore.exceptions.ConnectTimeoutError(endpoint_url="http://127.0.0.1:1"),
        botocore.exceptions.ReadTimeoutError(endpoint_url="http://127.0.0.1:1"),
        botocore.exceptions.ConnectionClosedError(endpoint_url="http://127.0.0.1:1"),
        botocore.exceptions.IncompleteReadError(actual_bytes=3, expected_bytes=10),
    ],
    ids=type,
)
def test_botocore_connection_failures_are_transient(error):
    assert is_transient(error)


def test_botocore_errors_about_the_request_itself_are_not_transient():
    assert not is_transient(botocore.exceptions.NoCredentialsError())
    assert not is_transient(botocore.exceptions.ParamValidationError(report="Invalid bucket name"))


def request_info():
    url = URL("http://127.0.0.1:1/b/o")
    return aiohttp.RequestInfo(url, "PUT", CIMultiDictProxy(CIMultiDict()), url)


@pytest.mark.parametrize(
    "error",
    [
        aiohttp.ServerDisconnectedError(),
        aiohttp.ServerTimeoutError("Timeout on reading data from socket"),
        aiohttp.ClientPayloadError("Response payload is not completed"),
        aiohttp.ClientOSError(errno.ECONNRESET, "Connection reset by peer"),
        aiohttp.ClientConnectorError(
            aiohttp.client_reqrep.ConnectionKey("127.0.0.1", 1, False, True, None, None, None),
            ConnectionRefusedError(errno.ECONNREFUSED, "Connect call failed"),
        ),
        aiohttp.ClientResponseError(request_info(), (), status=503, message="Service Unavailable"),
        aiohttp.ClientResponseError(request_info(), (), status=500, message="Internal Server Error"),
        aiohttp.ClientResponseError(request_info(), (), status=429, message="Too Many Requests"),
    ],
    ids=lambda error: f"{type(error).__name__}-{getattr(error, 'status', '')}",
)
def test_aiohttp_connection_failures_and_server_errors_are_transient(error):
    assert is_transient(error)


@pytest.mark.parametrize("status", [400, 401, 403, 404, 412])
def test_aiohttp_client_errors_are_not_transient(status):
    assert not is_transient(aiohttp.ClientResponseError(request_info(), (), status=status, message="no"))


def gcs_error(status, message):
    """What gcsfs raises for a GCS JSON API answer of ``status``, once its own tries are spent."""
    body = f'{{"error": {{"code": {status}, "message": "{message}"}}}}'.encode()
    with pytest.raises(Exception) as caught:
        gcsfs.retry.validate_response(status, body, "b/bucket/o/key")
    return caught.value


@pytest.mark.parametrize(
    "status, message, expected",
    [
        (500, "Backend Error", True),
        (503, "Service Unavailable", True),
        (429, "The object exceeded the rate limit for object mutation operations", True),
        (502, "Bad Gateway", True),  # gcsfs raises requests' ProxyError
        (504, "Gateway Timeout", True),
        (403, "Access denied.", False),
        (404, "Not Found", False),
        (412, "Precondition Failed", False),  # a create-only write that lost: never tried again
        (400, "Invalid bucket name", False),
    ],
)
def test_gcs_errors_as_gcsfs_raises_them(status, message, expected):
    assert is_transient(gcs_error(status, message)) is expected


@pytest.mark.parametrize(
    "error, expected",
    [
        (OSError(errno.ETIMEDOUT, "timed out"), True),
        (OSError(errno.EPIPE, "broken pipe"), True),
        (ConnectionRefusedError(errno.ECONNREFUSED, "refused"), True),
        (requests.exceptions.ConnectionError("connection aborted"), True),
        (requests.exceptions.ReadTimeout("read timed out"), True),
        (OSError(errno.ENOSPC, "no space left on device"), False),
        (IsADirectoryError(errno.EISDIR, "is a directory"), False),
        (FileExistsError(errno.EEXIST, "exists"), False),
        (PermissionError(errno.EACCES, "denied", "/tmp/x"), False),
        (KeyError("size"), False),
    ],
)
def test_os_and_requests_errors(error, expected):
    assert is_transient(error) is expected


def test_a_status_that_is_a_boolean_or_not_a_number_is_no_http_status():
    error = ValueError("no")
    error.status = True
    error.code = "500"
    assert not is_transient(error)


class AzureAnswers:
    """A loopback server answering every request as Blob Storage answers a failed one: ``status``
    with the error ``code`` (its XML body and ``x-ms-error-code`` header), or a connection closed
    without an answer (``status`` None)."""

    def __init__(self):
        import http.server
        import threading

        answers = self
        self.status, self.code = 500, "InternalError"

        class Handler(http.server.BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def do_PUT(self):
                self.rfile.read(int(self.headers.get("Content-Length") or 0))
                if answers.status is None:
                    self.close_connection = True
                    return
                body = (
                    f"<?xml version='1.0' encoding='utf-8'?><Error><Code>{answers.code}</Code>"
                    f"<Message>{answers.code} (injected)</Message></Error>"
                ).encode()
                self.send_response(answers.status)
                self.send_header("x-ms-error-code", answers.code)
                self.send_header("Content-Type", "application/xml")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

        self._server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=self._server.serve_forever, daemon=True).start()
        self.endpoint = f"http://127.0.0.1:{self._server.server_address[1]}/devstoreaccount1"

    def error(self, status, code=""):
        """What the Azure SDK raises for a Put Blob that gets this answer (its own retries off)."""
        from azure.storage.blob import BlobClient

        from support.stores import AZURITE_KEY

        self.status, self.code = status, code
        credential = {"account_name": "devstoreaccount1", "account_key": AZURITE_KEY}
        with BlobClient(self.endpoint, "container", "blob", credential=credential, retry_total=0) as client:
            with pytest.raises(Exception) as caught:
                client.upload_blob(b"shard", overwrite=True)
        return caught.value

    def close(self):
        self._server.shutdown()
        self._server.server_close()


@pytest.fixture(scope="module")
def azure_answers():
    answers = AzureAnswers()
    yield answers
    answers.close()


@pytest.mark.parametrize(
    "status, code, expected",
    [
        (500, "InternalError", True),
        (503, "ServerBusy", True),
        (400, "Md5Mismatch", True),  # the block's bytes are not those its Content-MD5 was computed of
        (None, "", True),  # the connection closed before an answer: ServiceResponseError
        (400, "InvalidHeaderValue", False),
        (403, "AuthenticationFailed", False),
        (404, "ContainerNotFound", False),
        (409, "BlobAlreadyExists", False),  # a create-only write that lost: never tried again
        (412, "ConditionNotMet", False),
    ],
)
def test_azure_errors_as_the_sdk_raises_them(azure_answers, status, code, expected):
    from azure.core.exceptions import AzureError

    error = azure_answers.error(status, code)
    assert isinstance(error, AzureError) and getattr(error, "status_code", None) == status
    assert is_transient(error) is expected


def test_an_azure_request_to_a_closed_port_is_transient():
    from azure.core.exceptions import ServiceRequestError
    from azure.storage.blob import BlobClient

    from support.stores import free_port

    client = BlobClient(f"http://127.0.0.1:{free_port()}/devstoreaccount1", "container", "blob", retry_total=0)
    with pytest.raises(ServiceRequestError) as caught:
        client.get_blob_properties()
    assert is_transient(caught.value)


def test_an_operation_inside_another_keeps_its_deadline_and_gives_it_back():
    """A check made inside an upload (reading the committed manifests before a put) must not
    leave the put that follows without the upload's deadline."""
    requests_ = Requests(RetryPolicy(max_tries=1))
    now, seen = time.monotonic(), []
    upload, earlier, later = now + 1000, now + 500, now + 5000

    def outer():
        seen.append(requests_.deadline)
        requests_.run("inner, none of its own", lambda: seen.append(requests_.deadline))
        requests_.run("inner, an earlier one", lambda: seen.append(requests_.deadline), deadline=earlier)
        requests_.run("inner, a later one", lambda: seen.append(requests_.deadline), deadline=later)
        seen.append(requests_.deadline)

    requests_.run("outer", outer, deadline=upload)
    assert seen == [upload, upload, earlier, upload, upload] and requests_.deadline is None
