"""A step's metrics (tiered_ckpt/format/metrics.py): what a save records and what a manifest may hold."""

import json
import logging
import math

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from tiered_ckpt import InvalidStateError, ManifestError, save_sharded
from tiered_ckpt.engine.shards import build_manifest
from tiered_ckpt.format.manifest import METRICS_SCHEMA_VERSION, REFERENCES_SCHEMA_VERSION, ShardManifest
from tiered_ckpt.format.metrics import MAX_METRICS, metrics_of, parse_metrics


def test_numbers_of_every_kind_are_recorded_as_floats_sorted_by_name():
    given_ = {"val_loss": torch.tensor(0.25), "acc": np.float32(0.5), "epoch": 3, "lr": 1e-4}
    assert metrics_of(given_, 1) == (("acc", 0.5), ("epoch", 3.0), ("lr", 1e-4), ("val_loss", 0.25))
    assert metrics_of(None, 1) == () and metrics_of({}, 1) == ()


def test_a_value_that_is_not_finite_is_recorded_as_none_with_a_warning(caplog):
    with caplog.at_level(logging.WARNING, logger="tiered_ckpt"):
        assert metrics_of({"loss": math.nan, "acc": torch.tensor(-math.inf)}, 7) == (("acc", None), ("loss", None))
    assert "step 7: metric 'loss' is nan; recorded as no value" in caplog.text


@pytest.mark.parametrize(
    "given_, problem",
    [
        ({"loss": "0.3"}, r"metrics\['loss'\] must be a real number, got str"),
        ({"loss": True}, r"metrics\['loss'\] must be a real number, got bool"),
        ({"loss": 1 + 2j}, r"must be a real number, got complex"),
        ({"loss": np.complex64(1)}, r"must be a real number, got complex64"),
        ({"loss": np.bool_(True)}, r"must be a real number, got bool"),
        ({"loss": torch.tensor(True)}, r"must be a real number, got Tensor"),
        ({"loss": np.array("1.5")}, r"must be a real number, got ndarray"),
        ({"loss": 10**400}, r"metrics\['loss'\] must be a number, got int: int too large"),
        ({"loss": [0.3]}, r"metrics\['loss'\] must be a number, got list"),
        ({"loss": torch.ones(2)}, r"metrics\['loss'\] must be a number, got Tensor"),
        ({1: 0.3}, "a metric's name must be a string, got int"),
        ({"": 0.3}, "a metric's name must be 1 to 200 printable characters"),
        ({"a\nb": 0.3}, "printable"),
        ({"x" * 201: 0.3}, "printable"),
        ({f"m{i}": 0.0 for i in range(MAX_METRICS + 1)}, "at most 64"),
        ([("loss", 0.3)], "metrics must be a dict of names to numbers, got list"),
    ],
)
def test_a_bad_metric_is_an_invalid_state_error_naming_it(given_, problem):
    with pytest.raises(InvalidStateError, match=problem):
        metrics_of(given_, 1)


@given(st.dictionaries(st.text(min_size=1, max_size=20).filter(str.isprintable), st.floats(), max_size=8))
def test_what_a_save_records_a_manifest_reads_back_unchanged(values):
    recorded = metrics_of(values, 1)
    assert parse_metrics(json.loads(json.dumps(dict(recorded))), "m") == recorded
    assert [value for _name, value in recorded] == [v if math.isfinite(v) else None for _k, v in sorted(values.items())]


def one_rank(tmp_path, metrics=()):
    manifest = save_sharded([{"w": np.ones(4, np.float32)}], tmp_path / "s", step=3)
    return build_manifest(3, manifest.shards, world_size=1, sharded_keys=(), wall_clock_seconds=1.0, metrics=metrics)


def test_a_manifest_with_metrics_is_version_4_and_round_trips(tmp_path):
    manifest = one_rank(tmp_path, (("acc", 0.5), ("loss", None)))
    document = json.loads(manifest.to_json())
    assert document["schema_version"] == METRICS_SCHEMA_VERSION and document["metrics"] == {"acc": 0.5, "loss": None}
    again = ShardManifest.from_json(manifest.to_json())
    assert again == manifest and again.metric("acc") == 0.5 and again.metric("loss") is None
    assert again.metric("missing") is None
    plain = one_rank(tmp_path / "plain")
    assert "metrics" not in json.loads(plain.to_json()) and plain.schema_version < METRICS_SCHEMA_VERSION


@pytest.mark.parametrize(
    "metrics, version, problem",
    [
        ({"loss": 0.5}, REFERENCES_SCHEMA_VERSION, "field 'metrics': metrics need schema_version 4"),
        ({"loss": "0.5"}, METRICS_SCHEMA_VERSION, "field 'metrics': 'loss' must be a finite number or null, got str"),
        ({"loss": True}, METRICS_SCHEMA_VERSION, "'loss' must be a finite number or null, got bool"),
        ([0.5], METRICS_SCHEMA_VERSION, "field 'metrics': expected an object, got list"),
        ({"": 0.5}, METRICS_SCHEMA_VERSION, "printable characters"),
        ({"loss": 10**400}, METRICS_SCHEMA_VERSION, "'loss' must be a finite number or null, got int"),
        ({f"m{i}": 0 for i in range(MAX_METRICS + 1)}, METRICS_SCHEMA_VERSION, "at most 64 are read"),
    ],
)
def test_a_manifests_metrics_are_untrusted_input(tmp_path, metrics, version, problem):
    document = json.loads(one_rank(tmp_path).to_json())
    document |= {"metrics": metrics, "schema_version": version}
    with pytest.raises(ManifestError, match=f"^/x/manifest.json: .*{problem}"):
        ShardManifest.from_json(json.dumps(document), source="/x/manifest.json")


def test_a_metric_that_is_not_finite_cannot_be_in_a_manifests_json(tmp_path):
    text = one_rank(tmp_path, (("loss", 0.5),)).to_json().replace("0.5", "NaN")
    with pytest.raises(ManifestError, match="NaN"):
        ShardManifest.from_json(text, source="/x/manifest.json")
