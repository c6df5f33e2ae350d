"""The bounds of the numeric options (tiered_ckpt/format/bounds.py): what consumes a number takes the
largest one an option accepts, and a refused number is named by its size."""

import math
import socket
import threading
import time
from datetime import timedelta

import pytest

from tiered_ckpt.errors import ConfigError
from tiered_ckpt.format.bounds import MAX_COUNT, MAX_SECONDS, check_number, shown
from tiered_ckpt.format.validate import MAX_STEP


def test_the_largest_seconds_are_taken_by_clocks_thread_waits_timedeltas_and_sockets():
    assert math.isfinite(time.monotonic() + MAX_SECONDS) and math.isfinite(time.time() + MAX_SECONDS)
    assert MAX_SECONDS < threading.TIMEOUT_MAX
    assert threading.Lock().acquire(timeout=MAX_SECONDS)  # a free lock: the timeout is checked, never waited
    assert threading.Lock().acquire(timeout=MAX_SECONDS / 4)  # a lease's renewal wait
    assert timedelta(seconds=MAX_SECONDS).total_seconds() == MAX_SECONDS  # a peer link's timeout
    with socket.socket() as probe:
        probe.settimeout(MAX_SECONDS)  # a request's timeout
        assert probe.gettimeout() == MAX_SECONDS


@pytest.mark.parametrize(
    "consume, value",
    [
        (lambda seconds: threading.Lock().acquire(timeout=seconds / 4), 1e300),  # a lease of 1e300 s
        (lambda seconds: timedelta(seconds=seconds), 1e14),  # a peer timeout of 1e14 s
        (lambda seconds: time.monotonic() + seconds, 10**400),  # an upload deadline of 10**400 s
    ],
)
def test_what_the_bound_keeps_out_fails_where_it_is_consumed(consume, value):
    with pytest.raises(OverflowError):
        consume(value)


def test_a_count_reaches_the_largest_step_and_no_further():
    assert MAX_COUNT == MAX_STEP == 2**63 - 1
    check_number("every", MAX_COUNT, 1, MAX_COUNT)
    with pytest.raises(ConfigError, match=r"^every must be <= 2\*\*63 - 1, got about 10\*\*400$"):
        check_number("every", 10**400, 1, MAX_COUNT)


@pytest.mark.parametrize(
    "value, text", [(10**400, "about 10**400"), (-(10**25), "-about 10**25"), (12, "12"), (1e300, "1e+300")]
)
def test_a_number_is_shown_whole_unless_it_is_too_long_to_read(value, text):
    assert shown(value) == text
