"""A Lightning .ckpt of a step the plugin saved (tiered_ckpt/lightning_export.py): read by Lightning's own
``load_from_checkpoint`` and by ``torch.load(weights_only=True)``, from the disk or the bucket alone."""

from __future__ import annotations

import hashlib
import json
import pathlib
import subprocess
import sys

import lightning as L
import ml_dtypes
import numpy as np
import pytest
import torch
from test_lightning import Capturing, Model, assert_module_of, assert_same, batches, saved_to_the_bucket_alone, trainer

from support.stores import s3_credentials_env, write_s3_config
from tiered_ckpt import CheckpointManager, InvalidStateError, RemoteOptions, UsageError
from tiered_ckpt.format.layout import step_dir_name
from tiered_ckpt.lightning_export import WEIGHTS_KEYS, export_lightning, write_lightning_file

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::DeprecationWarning", "ignore::FutureWarning")


def sha256(path: pathlib.Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_an_exported_ckpt_is_what_lightnings_own_load_from_checkpoint_reads(manager, tmp_path):
    io = Capturing(manager)
    trainer(io, tmp_path / "names", 4).fit(Model(lr=0.05, limits={"depth": 3}), batches())
    out = tmp_path / "export" / "model.ckpt"
    out.parent.mkdir()
    written = export_lightning(tmp_path / "names" / "last.ckpt", out)
    assert (written.name, written.size_bytes, written.sha256) == ("model.ckpt", out.stat().st_size, sha256(out))
    loaded = torch.load(out, weights_only=True)  # the restricted unpickler: tensors and plain values only
    assert list(loaded) == [key for key in WEIGHTS_KEYS if key in io.handed[4]] and "state_dict" in loaded
    assert_same({key: io.handed[4][key] for key in loaded}, loaded)
    module = Model.load_from_checkpoint(out)  # Lightning's own reader of files
    assert module.hparams.lr == 0.05 and module.hparams.limits == {"depth": 3}
    assert_module_of(io.handed[4], module)


def test_a_full_export_resumes_a_trainer_without_the_plugin(manager, tmp_path):
    io = Capturing(manager)
    trainer(io, tmp_path / "names", 4).fit(Model(), batches())
    out = tmp_path / "full.ckpt"
    export_lightning(manager.root / step_dir_name(4), out, full=True)
    assert_same(io.handed[4], torch.load(out, weights_only=True))  # every key, every value, as Lightning made it
    plain = L.Trainer(
        accelerator="cpu", max_steps=6, logger=False, enable_checkpointing=False, enable_progress_bar=False
    )
    plain.fit(Model(), batches(), ckpt_path=out)  # Lightning's default CheckpointIO reads it
    assert plain.global_step == 6


def test_an_export_reads_the_step_from_the_bucket_alone(tmp_path, s3_url):
    url, options = s3_url
    io = saved_to_the_bucket_alone(tmp_path, s3_url, 0.07)
    out = tmp_path / "served.ckpt"
    export_lightning(f"{url}/{step_dir_name(2)}", out, storage_options=options)
    assert_module_of(io.handed[2], Model.load_from_checkpoint(out))


def test_a_value_the_weights_only_reader_could_not_build_is_refused_and_nothing_is_written(tmp_path):
    out = tmp_path / "model.ckpt"
    out.write_bytes(b"an earlier export")
    weights = {"w": torch.ones(2), "n": np.arange(3)}
    with pytest.raises(InvalidStateError, match=r"checkpoint\['hyper_parameters'\]\['where'\]: a PosixPath cannot"):
        write_lightning_file({"state_dict": weights, "hyper_parameters": {"where": pathlib.Path("/x")}}, out)
    with pytest.raises(InvalidStateError, match=r"checkpoint\['state_dict'\]: a key .* that is not a str or int"):
        write_lightning_file({"state_dict": {(1, 2): torch.ones(1)}}, out)
    with pytest.raises(UsageError, match="holds no state_dict"):
        write_lightning_file({"weights": weights}, out)
    assert out.read_bytes() == b"an earlier export"  # untouched
    with pytest.raises(UsageError, match="the .ckpt file to write is a directory"):
        write_lightning_file({"state_dict": weights}, tmp_path)
    with pytest.raises(UsageError, match="which is not a directory"):
        write_lightning_file({"state_dict": weights}, tmp_path / "missing" / "model.ckpt")
    with pytest.raises(InvalidStateError, match=r"checkpoint\['hyper_parameters'\]\['when'\]: a date cannot"):
        write_lightning_file({"state_dict": weights, "hyper_parameters": {"when": np.datetime64(1, "D")}}, out)
    assert out.read_bytes() == b"an earlier export"
    scalars = {"lr": np.float64(0.1), "scale": np.array(2.0, dtype=np.float32)}  # as a restore gives them back
    bf16 = np.array([1.5, -2.0], dtype=ml_dtypes.bfloat16)
    write_lightning_file(
        {"state_dict": {**weights, "h": bf16}, "hyper_parameters": scalars, "optimizer_states": [{"lr": object()}]}, out
    )  # the optimizer states are no weights key: left out
    loaded = torch.load(out, weights_only=True)
    assert torch.equal(loaded["state_dict"]["n"], torch.arange(3))  # numpy: a tensor
    assert loaded["state_dict"]["h"].dtype == torch.bfloat16 and loaded["state_dict"]["h"].tolist() == [1.5, -2.0]
    assert loaded["hyper_parameters"]["lr"] == 0.1 and type(loaded["hyper_parameters"]["lr"]) is float
    assert loaded["hyper_parameters"]["scale"].shape == () and "optimizer_states" not in loaded


@pytest.mark.slow
def test_the_cli_exports_a_step_as_a_ckpt_from_a_config(tmp_path, s3_url, moto_endpoint):
    url, options = s3_url
    local = tmp_path / "ckpt"
    with CheckpointManager(local, remote=RemoteOptions(url, storage_options=options), world_size=1) as job:
        io = Capturing(job)
        trainer(io, tmp_path / "names", 2).fit(Model(lr=0.03), batches())
        job.wait(uploaded=True)
    config = write_s3_config(tmp_path / "ckpt.toml", local, url, moto_endpoint)
    out = tmp_path / "out.ckpt"
    command = [sys.executable, "-m", "tiered_ckpt", "--config", str(config), "--json", "export", "2", str(out)]
    done = subprocess.run([*command, "--format", "lightning"], capture_output=True, text=True, env=s3_credentials_env())
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout)
    assert result == {"step": 2, "file": str(out), "bytes": out.stat().st_size, "sha256": sha256(out)}
    assert_module_of(io.handed[2], Model.load_from_checkpoint(out))
    refused = subprocess.run([*command, "--full"], capture_output=True, text=True, env=s3_credentials_env())
    assert refused.returncode == 2 and "--full applies to --format lightning only" in refused.stderr
