import os

import pytest

from tiered_ckpt import DirectoryInUseError, IncompleteCheckpointError, ManifestError
from tiered_ckpt.io.durable import temp_name
from tiered_ckpt.io.files import directory_lock, open_regular, read_small, remove_temp_files


def test_remove_temp_files_removes_only_temp_files_of_the_given_targets(tmp_path):
    keep = ["manifest.json", "rank-00000-of-00002.safetensors", ".hidden"]
    for name in keep:
        (tmp_path / name).write_bytes(b"x")
    rank0_temp = temp_name("rank-00000-of-00002.safetensors")
    rank1_temp = temp_name("rank-00001-of-00002.safetensors")
    for name in (rank0_temp, rank1_temp):
        (tmp_path / name).write_bytes(b"partial")
    assert remove_temp_files(tmp_path, {"rank-00001-of-00002.safetensors"}) == [rank1_temp]
    assert remove_temp_files(tmp_path) == [rank0_temp]
    assert sorted(os.listdir(tmp_path)) == sorted(keep)


def test_directory_lock_refuses_a_second_holder(tmp_path):
    with directory_lock(tmp_path):
        with pytest.raises(DirectoryInUseError, match="in use by another"):
            with directory_lock(tmp_path):
                pass
    with directory_lock(tmp_path):
        pass
    assert os.listdir(tmp_path) == []


def test_only_a_regular_file_is_opened(tmp_path):
    target = tmp_path / "file"
    target.write_bytes(b"bytes")
    with open_regular(target, "the file") as opened:
        assert opened.read() == b"bytes"
    (tmp_path / "link").symlink_to(target)
    with pytest.raises(IncompleteCheckpointError, match="the link: is a symbolic link"):
        open_regular(tmp_path / "link", "the link")
    with pytest.raises(IncompleteCheckpointError, match="is a directory"):
        open_regular(tmp_path, "the directory")
    with pytest.raises(IncompleteCheckpointError, match="missing"):
        open_regular(tmp_path / "absent", "absent")


def test_a_small_read_refuses_a_file_over_its_limit(tmp_path):
    target = tmp_path / "record.json"
    target.write_bytes(b"x" * 100)
    assert read_small(target, 100) == b"x" * 100
    with pytest.raises(ManifestError, match="101 bytes, over the 100 byte limit"):
        target.write_bytes(b"x" * 101)
        read_small(target, 100)
