"""Preemption notices: real signals sent to this process, handlers chained and put back, the uploads after."""

from __future__ import annotations

import os
import signal

import numpy as np
import pytest

from tiered_ckpt import CheckpointManager, UsageError
from tiered_ckpt.coordination import SingleProcessCoordinator
from tiered_ckpt.preemption import PreemptionNotice, PreemptionWatch


@pytest.fixture
def usr1():
    """SIGUSR1 with a Python handler of the test's own installed, put back afterwards."""
    calls = []
    before = signal.signal(signal.SIGUSR1, lambda signum, frame: calls.append(signum))
    yield calls
    signal.signal(signal.SIGUSR1, before)


def test_a_signal_is_noted_and_the_previous_handler_still_runs(usr1):
    notice = PreemptionNotice([signal.SIGUSR1])
    assert notice.received is None
    os.kill(os.getpid(), signal.SIGUSR1)
    assert notice.received == signal.SIGUSR1
    assert usr1 == [signal.SIGUSR1]  # chained to the handler that was installed before
    notice.close()
    os.kill(os.getpid(), signal.SIGUSR1)
    assert usr1 == [signal.SIGUSR1, signal.SIGUSR1]  # the old handler is back
    assert signal.getsignal(signal.SIGUSR1) is not None and notice.signals == ()


def test_close_leaves_a_handler_installed_after_ours_alone(usr1):
    notice = PreemptionNotice([signal.SIGUSR1])
    later = signal.signal(signal.SIGUSR1, signal.SIG_IGN)  # someone else's, installed after ours
    notice.close()
    assert signal.getsignal(signal.SIGUSR1) == signal.SIG_IGN
    signal.signal(signal.SIGUSR1, later)


@pytest.mark.parametrize("bad", [signal.SIGKILL, 0, 10_000, "TERM", True])
def test_signals_that_cannot_be_caught_are_refused(bad):
    with pytest.raises(UsageError, match="preemption_signals"):
        PreemptionNotice([bad])


def test_handlers_are_refused_off_the_main_thread():
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(1) as pool, pytest.raises(UsageError, match="main thread"):
        pool.submit(PreemptionNotice, [signal.SIGUSR1]).result()


def test_the_watch_turns_true_at_the_first_step_after_the_signal_and_stays_true(usr1):
    reached = []
    notice = PreemptionNotice([signal.SIGUSR1])
    watch = PreemptionWatch(notice, SingleProcessCoordinator(1), reached.append)
    assert not watch.reached(5)
    os.kill(os.getpid(), signal.SIGUSR1)
    assert watch.reached(6) and watch.reached(7)
    assert reached == [6] and watch.step == 6  # the uploads are told once
    notice.close()


def test_a_manager_installs_its_handlers_and_puts_the_old_ones_back_on_close(tmp_path, usr1):
    with CheckpointManager(tmp_path, world_size=1, preemption_signals=(signal.SIGUSR1,)) as manager:
        state = {"w": np.arange(4.0), "step": 0}
        for step in range(1, 10):
            state["step"] = step
            if step == 4:
                os.kill(os.getpid(), signal.SIGUSR1)
            if manager.reached_preemption(step):
                manager.save(step, state, blocking=True)
                manager.wait(uploaded=True)
                break
        assert step == 4 and manager.steps() == [4]
    assert usr1 == [signal.SIGUSR1]
    os.kill(os.getpid(), signal.SIGUSR1)
    assert usr1 == [signal.SIGUSR1, signal.SIGUSR1]
    with pytest.raises(UsageError, match="closed"):
        manager.reached_preemption(10)
