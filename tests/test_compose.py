"""The manager's parts (tiered_ckpt/compose.py): opened in order, closed in reverse, once."""

import logging
import signal
import threading

import numpy as np
import pytest

from tiered_ckpt import DirectoryInUseError, RemoteOptions, RuntimeOptions, UsageError
from tiered_ckpt.compose import open_parts
from tiered_ckpt.dist.coordination import Attempt, SingleProcessCoordinator
from tiered_ckpt.engine.saving import check_save
from tiered_ckpt.options import resolve_options
from tiered_ckpt.tiers import survey


def parts_on(directory, world_size=2, signals=(), remote=None):
    options = resolve_options(directory, remote, runtime=RuntimeOptions(preemption_signals=signals))
    coordinator = SingleProcessCoordinator(world_size)
    return open_parts(options, coordinator)


def test_open_holds_the_directory_until_close_and_a_second_close_does_nothing(tmp_path):
    parts = parts_on(tmp_path)
    with pytest.raises(DirectoryInUseError):
        parts_on(tmp_path)
    parts.close("first")
    parts.close("first")  # nothing left to close
    assert parts.closed
    parts_on(tmp_path).close("second")


def uploader_threads():
    return [thread for thread in threading.enumerate() if thread.name == "tiered-ckpt-uploader"]


def test_a_failure_while_opening_closes_what_was_opened(tmp_path, memory_url):
    from concurrent.futures import ThreadPoolExecutor

    url, storage_options = memory_url
    before = uploader_threads()
    remote = RemoteOptions(url, storage_options=storage_options)
    # Signal handlers are installed after the lock and the uploader, and only from the main thread.
    with ThreadPoolExecutor(1) as pool, pytest.raises(UsageError, match="only be installed from the main thread"):
        pool.submit(parts_on, tmp_path, signals=(signal.SIGUSR1,), remote=remote).result()
    assert uploader_threads() == before  # the uploader was stopped
    parts_on(tmp_path).close("after the failure")  # and the directory released


def test_open_removes_what_crashed_saves_left_and_says_so(tmp_path, caplog):
    (tmp_path / "step-000000000007").mkdir(parents=True)  # a step without its manifest
    with caplog.at_level(logging.WARNING, logger="tiered_ckpt"):
        parts = parts_on(tmp_path)
    parts.close("test")
    assert not (tmp_path / "step-000000000007").exists()
    assert "removed what crashed saves left in" in caplog.text and "step-000000000007" in caplog.text


def test_a_write_queued_before_close_is_committed_by_close(tmp_path):
    parts = parts_on(tmp_path)
    states = [{"w": np.arange(4, dtype=np.float32) + rank} for rank in range(2)]
    plan = check_save(
        SingleProcessCoordinator(2), 3, states, checked=Attempt(None), sharded_keys=None, where=str(tmp_path)
    )
    parts.writer.submit(3, plan)
    parts.close("test")  # the writer closes first: the write it holds is finished, then the directory is released
    assert parts.store.local.steps() == [3]
    lag = survey.lag(parts.store)
    assert lag.newest_local == 3 and lag.newest_remote is None
