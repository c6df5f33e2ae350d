"""Preemption notices: real signals sent to this process, handlers chained and put back, the uploads after."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

from tiered_ckpt import (
    CheckpointExistsError,
    CheckpointManager,
    RemoteOptions,
    RuntimeOptions,
    UploadError,
    UploadOptions,
    UsageError,
)
from tiered_ckpt.dist.coordination import SingleProcessCoordinator
from tiered_ckpt.engine.preemption import Preemption, PreemptionNotice, PreemptionWatch


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


def test_handlers_are_refused_off_the_main_thread():
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(1) as pool, pytest.raises(UsageError, match="main thread"):
        pool.submit(PreemptionNotice, [signal.SIGUSR1]).result()


def test_the_watch_stops_at_the_first_step_after_the_signal_and_stays_stopped(usr1):
    notice = PreemptionNotice([signal.SIGUSR1])
    watch = PreemptionWatch(notice, SingleProcessCoordinator(1))
    assert watch.reached(5) == Preemption(stop=False)
    os.kill(os.getpid(), signal.SIGUSR1)
    assert watch.reached(6) == Preemption(stop=True, new=True, signals={0: "SIGUSR1"})
    assert watch.reached(7) == Preemption(stop=True)  # new once: the caller acts on it once
    assert watch.step == 6
    notice.close()


def test_a_manager_installs_its_handlers_and_puts_the_old_ones_back_on_close(tmp_path, usr1):
    with CheckpointManager(
        tmp_path, world_size=1, runtime=RuntimeOptions(preemption_signals=(signal.SIGUSR1,))
    ) as manager:
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


# -- one handler per signal, whatever order notices close in -------------------------------------

README = Path(__file__).resolve().parents[2] / "README.md"


def run_child(tmp_path, code: str, *, kill_after_ready: bool = False) -> tuple[int, str]:
    """Run ``code`` in a fresh Python; with ``kill_after_ready``, send it SIGTERM (kill -TERM) once it
    prints "ready" and then close its stdin (a child that survived reads EOF and exits 3)."""
    script = tmp_path / f"child-{len(list(tmp_path.glob('child-*')))}.py"
    script.write_text(textwrap.dedent(code))
    child = subprocess.Popen(
        [sys.executable, str(script), str(tmp_path)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    try:
        output = ""
        if kill_after_ready:
            output = child.stdout.readline()
            assert output == "ready\n", output
            child.send_signal(signal.SIGTERM)
            child.stdin.close()
        output += child.stdout.read()
        return child.wait(timeout=120), output  # a guard against a hang, not a timing
    finally:
        child.kill()


TWO_MANAGERS = """
    import signal, sys, threading
    from tiered_ckpt import CheckpointManager, RuntimeOptions

    root = sys.argv[1]
    runtime = RuntimeOptions(preemption_signals=(signal.SIGTERM,))
    first = CheckpointManager(root + "/a", world_size=1, runtime=runtime)
    second = CheckpointManager(root + "/b", world_size=1, runtime=runtime)
    {close}
    print("ready", flush=True)
    sys.stdin.read()  # until SIGTERM ends this process, as it would have without the managers
    print("survived SIGTERM", flush=True)
    sys.exit(3)
"""

CLOSINGS = {
    "out of the order they were opened": "first.close(); second.close()",
    "in the reverse order": "second.close(); first.close()",
    "the last one off the main thread": (
        "first.close(); closing = threading.Thread(target=second.close); closing.start(); closing.join()"
    ),
}


@pytest.mark.parametrize("order", CLOSINGS)
def test_a_process_whose_managers_are_closed_in_any_order_dies_on_sigterm(tmp_path, order):
    code, output = run_child(tmp_path, TWO_MANAGERS.format(close=CLOSINGS[order]), kill_after_ready=True)
    assert code == -signal.SIGTERM, output


def test_notices_closed_out_of_order_put_the_original_handler_back_and_chain_to_it_once(usr1):
    original = signal.getsignal(signal.SIGUSR1)
    first, second = PreemptionNotice([signal.SIGUSR1]), PreemptionNotice([signal.SIGUSR1, signal.SIGUSR1])
    os.kill(os.getpid(), signal.SIGUSR1)
    assert first.received == second.received == signal.SIGUSR1
    assert usr1 == [signal.SIGUSR1]  # the user's handler ran once, not once per notice
    first.close()
    assert signal.getsignal(signal.SIGUSR1) is not original  # the second notice still listens
    third = PreemptionNotice([signal.SIGUSR1])
    os.kill(os.getpid(), signal.SIGUSR1)
    assert third.received == signal.SIGUSR1 and usr1 == [signal.SIGUSR1] * 2
    second.close()
    third.close()
    assert signal.getsignal(signal.SIGUSR1) is original
    first.close()  # closing again changes nothing
    assert signal.getsignal(signal.SIGUSR1) is original


def test_a_notice_after_one_closed_off_the_main_thread_still_puts_the_original_handler_back(usr1):
    from concurrent.futures import ThreadPoolExecutor

    original = signal.getsignal(signal.SIGUSR1)
    closed_elsewhere = PreemptionNotice([signal.SIGUSR1])
    with ThreadPoolExecutor(1) as pool:
        pool.submit(closed_elsewhere.close).result()  # cannot put the handler back: not the main thread
    os.kill(os.getpid(), signal.SIGUSR1)
    assert closed_elsewhere.received is None and usr1 == [signal.SIGUSR1]  # ours stays, acting as the original
    notice = PreemptionNotice([signal.SIGUSR1])
    os.kill(os.getpid(), signal.SIGUSR1)
    assert notice.received == signal.SIGUSR1 and usr1 == [signal.SIGUSR1] * 2  # chained once, not twice
    notice.close()
    assert signal.getsignal(signal.SIGUSR1) is original


# -- SIGINT: a notice replaces KeyboardInterrupt --------------------------------------------------


SIGINT_CHILD = """
    import json, os, signal, sys
    import numpy as np
    from tiered_ckpt import CheckpointManager, RuntimeOptions

    before = signal.getsignal(signal.SIGINT)
    runtime = RuntimeOptions(preemption_signals=(signal.SIGINT,))
    with CheckpointManager(sys.argv[1] + "/ckpt", world_size=1, runtime=runtime) as manager:
        state = {"w": np.arange(4.0), "step": 0}
        for step in range(1, 10):
            state["step"] = step
            if step == 4:
                os.kill(os.getpid(), signal.SIGINT)  # Ctrl-C, or a launcher's SIGINT: noted, nothing raised
            if manager.reached_preemption(step):
                manager.save(step, state, blocking=True)
                break
        result = {"step": step, "steps": manager.steps(), "restored": int(manager.restore().state["step"])}
    result["put_back"] = signal.getsignal(signal.SIGINT) is before is signal.default_int_handler
    try:
        os.kill(os.getpid(), signal.SIGINT)  # once closed, Ctrl-C interrupts again
        result["then"] = "nothing"
    except KeyboardInterrupt:
        result["then"] = "KeyboardInterrupt"
    print(json.dumps(result))
"""


@pytest.mark.slow
def test_a_sigint_notice_saves_the_stop_step_and_raises_no_keyboard_interrupt(tmp_path):
    # In a child: were the notice to let KeyboardInterrupt through, it would end this test
    # session, not fail one test.
    code, output = run_child(tmp_path, SIGINT_CHILD)
    assert code == 0, output
    assert json.loads(output) == {"step": 4, "steps": [4], "restored": 4, "put_back": True, "then": "KeyboardInterrupt"}


def test_a_sigint_handler_of_the_users_own_is_still_chained():
    calls = []
    before = signal.signal(signal.SIGINT, lambda signum, frame: calls.append(signum))
    try:
        notice = PreemptionNotice([signal.SIGINT])
        os.kill(os.getpid(), signal.SIGINT)
        assert notice.received == signal.SIGINT and calls == [signal.SIGINT]
        notice.close()
    finally:
        signal.signal(signal.SIGINT, before)


# -- the README's loop, with the notice at the worst moment --------------------------------------


def readme_preemption_loop() -> str:
    """The training loop of the README's first sample that asks reached_preemption, as printed."""
    for block in re.findall(r"```python\n(.*?)```", README.read_text(), re.S):
        if "reached_preemption" in block and "for step in range(" in block:
            start = block.rindex("\n", 0, block.index("for step in range(")) + 1
            return textwrap.dedent(block[start:])
    raise AssertionError("README.md has no sample with a loop asking reached_preemption")


README_LOOP_CHILD = """
    import json, os, signal, sys
    import numpy as np
    import tiered_ckpt

    SIGNAL_AT, WHEN = {signal_at}, {when!r}
    total_steps, start = 1000, 0
    sent = []

    def send_notice():
        if not sent:
            sent.append(True)
            os.kill(os.getpid(), signal.SIGTERM)  # what a spot instance's preemption notice is

    class Manager(tiered_ckpt.CheckpointManager):
        def save(self, step, states, **kwargs):
            handle = super().save(step, states, **kwargs)
            if step == SIGNAL_AT and WHEN == "right after the step's regular save":
                send_notice()
            return handle

    def train_one_step():
        if step == SIGNAL_AT and WHEN == "during the step":
            send_notice()

    def training_state(step):
        return {{"w": np.full(4, float(step)), "data": {{"step": step}}}}

    local = tiered_ckpt.LocalOptions(sys.argv[1] + "/ckpt", keep_last=3)
    runtime = tiered_ckpt.RuntimeOptions(preemption_signals=(signal.SIGTERM,))
    with Manager(local, world_size=1, runtime=runtime) as manager:
{loop}
    sys.exit(5)  # the loop ran to its end: the notice was never acted on
"""


@pytest.mark.parametrize(
    "signal_at, when",
    [
        pytest.param(200, "right after the step's regular save", marks=pytest.mark.slow),
        (200, "during the step"),
        (201, "during the step"),
    ],
)
def test_the_readme_loop_saves_the_stop_step_whenever_the_notice_arrives(tmp_path, signal_at, when):
    loop = textwrap.indent(readme_preemption_loop(), " " * 8)
    code, output = run_child(tmp_path, README_LOOP_CHILD.format(signal_at=signal_at, when=when, loop=loop))
    assert code == 0, output  # sys.exit(0) after the stop step's save: no CheckpointExistsError
    with CheckpointManager(tmp_path / "ckpt", world_size=1) as manager:
        steps = manager.steps()
        restored = manager.restore()
    stop = 201 if when == "right after the step's regular save" else signal_at
    assert steps[-1] == stop == restored.state["data"]["step"]
    assert 200 in steps  # the regular save of step 200 is kept too


def test_saving_a_stop_step_saved_already_says_to_ask_before_the_regular_save(tmp_path, usr1):
    with CheckpointManager(
        tmp_path, world_size=1, runtime=RuntimeOptions(preemption_signals=(signal.SIGUSR1,))
    ) as manager:
        manager.save(200, {"w": np.ones(2)}, blocking=True)  # the regular save, then the notice
        os.kill(os.getpid(), signal.SIGUSR1)
        assert manager.reached_preemption(200)
        with pytest.raises(CheckpointExistsError, match=r"ask reached_preemption\(step\) before the step's regular"):
            manager.save(200, {"w": np.ones(2)}, blocking=True)
        assert manager.steps() == [200]


@pytest.mark.slow
def test_reached_preemption_puts_the_newest_upload_first_and_drops_the_older_queued_ones(
    tmp_path, moto_endpoint, s3_url, usr1
):
    from support.stores import FaultInjectingProxy, s3_storage_options
    from tiered_ckpt.tiers.remote.tier import RemoteTier

    url, options = s3_url
    state = {"weights": np.arange(64, dtype=np.float32)}
    proxy = FaultInjectingProxy(moto_endpoint, failure_rate=1.0, methods=("PUT",))  # every upload refused: 503
    try:
        storage = s3_storage_options(proxy.endpoint)
        with CheckpointManager(
            tmp_path,
            world_size=1,
            remote=RemoteOptions(url, storage_options=storage),
            runtime=RuntimeOptions(preemption_signals=[signal.SIGUSR1]),
        ) as manager:
            handles = {step: manager.save(step, state, blocking=True) for step in (1, 2, 3)}
            # step 1's upload is tried again; 2 and 3 wait behind it
            os.kill(os.getpid(), signal.SIGUSR1)
            assert manager.reached_preemption(4)  # the manager tells its uploads: the newest first
            proxy.failure_rate = 0.0  # the bucket is back
            handles[4] = manager.save(4, state, blocking=True)
            manager.wait(uploaded=True)
            assert handles[4].uploaded.result() is None
    finally:
        proxy.close()
    committed = RemoteTier(url, options).steps()
    # in order, step 2 would follow step 1; newest first, it is always passed over (3 or 4 is newer)
    assert 4 in committed and 2 not in committed, committed
    assert isinstance(handles[2].uploaded.exception(timeout=0), UploadError)  # passed over: stays local-only


@pytest.mark.slow
def test_a_stop_step_off_the_buckets_cadence_whose_upload_was_cut_off_is_resumed_by_the_next_start(
    tmp_path, moto_endpoint, s3_url, usr1
):
    from support.stores import FaultInjectingProxy, s3_storage_options
    from tiered_ckpt.tiers.remote.tier import RemoteTier

    url, options = s3_url
    state = {"weights": np.arange(64, dtype=np.float32)}
    proxy = FaultInjectingProxy(moto_endpoint, failure_rate=1.0, methods=("PUT",))  # the bucket is down
    cut_short = UploadOptions(max_tries=1, backoff_seconds=0.01, deadline_seconds=0.2)  # a grace period's end
    try:
        with CheckpointManager(
            tmp_path,
            world_size=1,
            remote=RemoteOptions(url, storage_options=s3_storage_options(proxy.endpoint), every=10),
            upload=cut_short,
            runtime=RuntimeOptions(preemption_signals=[signal.SIGUSR1]),
        ) as manager:
            manager.save(10, state, blocking=True)
            skipped = manager.save(11, state, blocking=True).uploaded  # off the bucket's cadence
            assert skipped is not None and "remote.every" in str(skipped.exception())
            os.kill(os.getpid(), signal.SIGUSR1)
            assert manager.reached_preemption(13)
            stop = manager.save(13, state, blocking=True)
            assert isinstance(stop.uploaded.exception(), UploadError)  # the stop step is the bucket's too
    finally:
        proxy.close()
    with CheckpointManager(
        tmp_path, world_size=1, remote=RemoteOptions(url, storage_options=options, every=10)
    ) as manager:
        manager.wait(uploaded=True)
        assert manager.steps() == [10, 11, 13]
    assert RemoteTier(url, options).steps() == [10, 13]  # step 11 never goes; the stop step does, after a restart
