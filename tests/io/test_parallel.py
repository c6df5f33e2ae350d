import threading

import pytest

from tiered_ckpt.io.parallel import default_workers, run_parallel


def test_results_come_back_in_the_order_of_the_items():
    assert run_parallel(lambda n: n * n, list(range(20)), 4) == [n * n for n in range(20)]
    assert run_parallel(lambda n: n, [], None) == []
    assert default_workers(1) == 1 and default_workers(10_000) >= 1


def test_the_first_failure_is_raised_once_every_started_call_has_ended():
    started, release, ended = threading.Barrier(2), threading.Event(), []

    def work(item):
        if item == 0:
            started.wait()
            raise OSError("disk full")
        started.wait()
        release.wait(timeout=60)  # a guard against a hang, not a timing assertion
        ended.append(item)

    def fail_then_release(item):
        try:
            return work(item)
        finally:
            if item == 0:
                release.set()

    with pytest.raises(OSError, match="disk full"):
        run_parallel(fail_then_release, [0, 1], 2)
    assert ended == [1]  # the other writer had finished when the error was seen
