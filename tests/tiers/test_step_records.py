"""The small records of a local step directory: each read back as written, a damaged one as its safe default."""

import pytest
from hypothesis import given
from hypothesis import strategies as st

from tiered_ckpt.errors import ManifestError
from tiered_ckpt.format.layout import AGREEMENT_NAME, EVERY_TIER_NAME, HELD_NAME, RECEIPT_NAME
from tiered_ckpt.tiers import step_records


@given(ranks=st.sets(st.integers(0, 7)))
def test_held_ranks_read_back_as_written_and_every_rank_needs_no_record(tmp_path_factory, ranks):
    directory = tmp_path_factory.mktemp("step")
    step_records.write_held(directory, ranks, 8)
    assert step_records.held_ranks(directory, 8) == (sorted(ranks) if len(ranks) < 8 else list(range(8)))
    assert (directory / HELD_NAME).exists() == (len(ranks) < 8)


@pytest.mark.parametrize("document", ['{"ranks": [9]}', '{"ranks": "0"}', '{"ranks": [0], "x": 1}', "not json"])
def test_a_held_record_that_does_not_validate_is_an_error_naming_the_file(tmp_path, document):
    (tmp_path / HELD_NAME).write_text(document)
    with pytest.raises(ManifestError, match=HELD_NAME):
        step_records.held_ranks(tmp_path, 8)


def test_the_other_records_read_back_as_written_for_their_own_step_only(tmp_path):
    step_records.write_agreement(tmp_path, 5, False)
    step_records.write_every_tier(tmp_path, 5)
    step_records.write_receipt(tmp_path, "s3://bucket/run", 5, 12.5)
    assert step_records.agreement(tmp_path, 5) is False and step_records.agreement(tmp_path, 6) is None
    assert step_records.for_every_tier(tmp_path, 5) and not step_records.for_every_tier(tmp_path, 6)
    assert step_records.has_receipt(tmp_path, "s3://bucket/run") and not step_records.has_receipt(tmp_path, "s3://b")


@pytest.mark.parametrize("damage", ["", "{", '{"step": 5, "every_tier": 1}', "[]", "\xff"])
def test_a_damaged_record_reads_as_absent(tmp_path, damage):
    for name in (AGREEMENT_NAME, EVERY_TIER_NAME, RECEIPT_NAME):
        (tmp_path / name).write_text(damage, errors="surrogateescape")
    assert step_records.agreement(tmp_path, 5) is None
    assert not step_records.for_every_tier(tmp_path, 5)
    assert not step_records.has_receipt(tmp_path, "s3://bucket/run")
