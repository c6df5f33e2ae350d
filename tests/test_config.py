import dataclasses
import os
import re
import signal
import tomllib
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import yaml

from support.states import ZERO1_SHARDED_KEYS, assert_states_equal
from tiered_ckpt import (
    CheckpointManager,
    Config,
    ConfigError,
    PeerOptions,
    RemoteOptions,
    RuntimeOptions,
    UploadOptions,
    load_config,
)
from tiered_ckpt.build import open_remote_tier

CONFIGS = sorted((Path(__file__).resolve().parent.parent / "configs").iterdir())


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_every_shipped_config_loads_and_works_with_one_process_per_rank(path):
    config = load_config(path, environ={})
    assert isinstance(config, Config) and config.source == str(path)
    read = tomllib.loads if path.suffix == ".toml" else yaml.safe_load
    written = Path(read(path.read_text())["local"]["dir"])
    # as each header says: a relative dir is next to the file, wherever the file is; an absolute one is
    # a fast disk, never a home directory
    if written.is_absolute():
        assert config.local.dir == written and not written.is_relative_to(Path.home())
    else:
        assert "from this file's folder" in path.read_text()
        assert config.local.dir == path.parent.absolute() / written
    # "skip" is refused with one process per rank (torchrun); no shipped config may need one process
    assert config.upload.when_behind == "wait"
    # a named AWS profile fails for everyone who does not have it
    assert "profile" not in (config.remote.storage_options if config.remote else {})


def test_the_local_config_writes_next_to_itself_not_into_the_home_directory(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    config = load_config(CONFIGS[0].parent / "local.toml", environ={})
    assert config.local.dir == CONFIGS[0].parent.resolve() / "checkpoints" / "my-run"


@pytest.mark.parametrize("endpoint", ["admin:hunter2@minio:9000", "https://admin:hunter2@minio:9000"])
def test_an_endpoint_url_with_a_password_is_refused_from_a_file_the_environment_or_an_argument(tmp_path, endpoint):
    given = write(tmp_path, f"[local]\ndir = 'x'\n[remote]\nurl = 's3://b/run'\nendpoint_url = '{endpoint}'\n")
    plain = write(tmp_path, "[local]\ndir = 'x'\n[remote]\nurl = 's3://b/run'\n", "plain.toml")
    ways = [
        lambda: load_config(given, environ={}),
        lambda: load_config(plain, environ={"TIERED_CKPT_REMOTE_ENDPOINT_URL": endpoint}),
        lambda: load_config(plain, environ={}, overrides={"remote.endpoint_url": endpoint}),
        lambda: RemoteOptions("s3://b/run", endpoint_url=endpoint),
    ]
    for way in ways:
        with pytest.raises(ConfigError, match="endpoint_url'? must not hold credentials") as caught:
            way()
        assert "hunter2" not in str(caught.value) and "admin" not in str(caught.value)


@pytest.mark.parametrize(
    "endpoint, shown",
    [("minio:9000", "got no scheme"), ("s3://minio:9000", "got scheme s3://"), ("hunter2://m", "got another scheme")],
)
def test_an_endpoint_url_that_is_not_http_names_only_a_known_scheme(endpoint, shown):
    with pytest.raises(ConfigError, match=f"must be an http:// or https:// URL, {shown}") as caught:
        RemoteOptions("s3://b/run", endpoint_url=endpoint)
    assert "minio" not in str(caught.value) and "hunter2" not in str(caught.value)


def test_a_relative_local_dir_is_taken_from_the_config_files_folder(tmp_path, monkeypatch):
    folder = tmp_path / "project"
    folder.mkdir()
    write(folder, "[local]\ndir = 'ckpt/run'\n")
    monkeypatch.chdir(tmp_path)
    assert load_config("project/ckpt.toml", environ={}).local.dir == folder / "ckpt" / "run"
    # the environment and arguments are relative to the working directory, as on a command line
    assert load_config("project/ckpt.toml", environ={"TIERED_CKPT_LOCAL_DIR": "here"}).local.dir == Path("here")
    assert load_config(folder / "ckpt.toml", environ={}, overrides={"local.dir": "there"}).local.dir == Path("there")


class OneOfTwoRanks:
    """Rank 0 of 2, whose partner sends what it sends: for the checks made by a manager's first collective."""

    world_size, local_ranks, is_leader = 2, (0,), True

    def all_gather(self, payload):
        return [payload, payload]


def test_skip_from_a_config_is_refused_with_one_process_per_rank_naming_the_file_and_key(tmp_path):
    path = write(tmp_path, "local: {dir: x}\nupload: {when_behind: skip}\n", "ckpt.yaml")
    with pytest.raises(ConfigError, match="key 'upload.when_behind' is 'skip'.*one process holding every rank") as e:
        CheckpointManager.from_config(path, coordinator=OneOfTwoRanks())
    assert str(e.value).startswith(f"{path}: ") and "when_uploads_behind" not in str(e.value)
    environ = {"TIERED_CKPT_LOCAL_DIR": str(tmp_path), "TIERED_CKPT_UPLOAD_WHEN_BEHIND": "skip"}
    with pytest.raises(ConfigError, match=r"^environment \(TIERED_CKPT_UPLOAD_WHEN_BEHIND\): key 'upload.when_"):
        CheckpointManager.from_config(load_config(environ=environ), coordinator=OneOfTwoRanks())


@pytest.mark.parametrize("value", ["nan", "inf", "-inf", "-1.0"])
@pytest.mark.parametrize("key", ["deadline_seconds", "timeout_seconds", "backoff_seconds", "max_seconds"])
def test_nan_infinite_and_negative_seconds_are_refused_naming_the_source_and_key(tmp_path, key, value):
    toml = {"nan": "nan", "inf": "inf", "-inf": "-inf", "-1.0": "-1.0"}[value]
    with pytest.raises(ConfigError, match=f"ckpt.toml: key 'upload.{key}' must be"):
        load_config(write(tmp_path, f"[local]\ndir = 'x'\n[upload]\n{key} = {toml}\n"), environ={})
    variable = f"TIERED_CKPT_UPLOAD_{key.upper()}"
    with pytest.raises(ConfigError, match=rf"environment \({variable}\): key 'upload.{key}' must be"):
        load_config(environ={"TIERED_CKPT_LOCAL_DIR": "x", variable: value})
    with pytest.raises(ConfigError, match="must be"):
        UploadOptions(**{key: float(value)})


@pytest.mark.parametrize(
    "table, key, toml, variable",
    [
        ("upload", "deadline_seconds", "1" + "0" * 400, "1e300"),
        ("remote", "orphan_age_seconds", "1" + "0" * 400, "1e300"),
        ("remote", "lease_seconds", "1" + "0" * 400, "1e300"),
        ("peer", "timeout_seconds", "1e14", "1e14"),
        ("remote", "keep_last", "1" + "0" * 400, str(2**63)),
    ],
)
def test_a_number_its_consumer_would_fail_on_is_refused_naming_the_source_and_key(tmp_path, table, key, toml, variable):
    remote = "url = 'memory://bucket/run'\n" if table == "remote" else ""
    path = write(tmp_path, f"[local]\ndir = 'x'\n[{table}]\n{remote}{key} = {toml}\n")
    with pytest.raises(ConfigError, match=f"ckpt.toml: key '{table}.{key}' must be <= "):
        load_config(path, environ={})
    name = f"TIERED_CKPT_{table.upper()}_{key.upper()}"
    environ = {"TIERED_CKPT_LOCAL_DIR": "x", "TIERED_CKPT_REMOTE_URL": "memory://bucket/run", name: variable}
    with pytest.raises(ConfigError, match=rf"^environment \({name}\): key '{table}.{key}' must be <= "):
        load_config(environ=environ)


def test_an_unknown_override_names_the_key_and_how_keys_are_spelled(tmp_path):
    with pytest.raises(ConfigError, match=r"override 'remote_url': no such config key \(a key is 'table.key'"):
        load_config(environ={"TIERED_CKPT_LOCAL_DIR": "x"}, overrides={"remote_url": "s3://b/run"})


def test_a_bad_override_names_the_override_and_the_key(tmp_path):
    with pytest.raises(
        ConfigError, match=r"^override 'upload.deadline_seconds': key 'upload.deadline_seconds' must be"
    ):
        load_config(environ={"TIERED_CKPT_LOCAL_DIR": "x"}, overrides={"upload.deadline_seconds": float("nan")})


def test_yaml_aliases_are_refused_so_a_tiny_file_cannot_expand_into_billions_of_values(tmp_path):
    # nine levels of ten aliases each: 10**9 leaves from a file of under 1 KB ("billion laughs")
    lines = ["local: {dir: x}", "remote:", "  url: s3://b/run", "  storage_options:", '    a0: &a0 ["lol"]']
    lines += [f"    a{i}: &a{i} [{', '.join([f'*a{i - 1}'] * 10)}]" for i in range(1, 10)]
    path = write(tmp_path, "\n".join(lines) + "\n", "bomb.yaml")
    assert path.stat().st_size < 2048
    with pytest.raises(ConfigError, match=r"bomb.yaml: line 6: YAML aliases \(\*a0\) are not allowed"):
        load_config(path, environ={})


@pytest.mark.parametrize(
    "options",
    [
        "{config_kwargs: {proxies: [[{aws_secret_access_key: hunter2-secret}]]}}",
        "{client_kwargs: [{nested: [[[{password: hunter2-secret}]]]}]}",
    ],
)
def test_a_credential_anywhere_in_lists_of_lists_is_refused(tmp_path, options):
    path = write(tmp_path, f"local: {{dir: x}}\nremote: {{url: 's3://b/run', storage_options: {options}}}\n", "c.yaml")
    with pytest.raises(ConfigError, match="holds a credential") as caught:
        load_config(path, environ={})
    assert "hunter2" not in str(caught.value)


def test_shipped_configs_cover_local_s3_compatible_gcs_and_demo():
    names = {path.name for path in CONFIGS}
    assert {"local.toml", "s3.toml", "s3-compatible.yaml", "gcs.toml", "demo.toml"} <= names
    assert load_config(CONFIGS[0].parent / "local.toml", environ={}).remote is None


def write(tmp_path, text: str, name: str = "ckpt.toml") -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


FULL = """
[local]
dir = "/data/ckpt"
keep_last = 4
[remote]
url = "s3://bucket/run"
keep_last = 7
[remote.storage_options]
endpoint_url = "http://127.0.0.1:9000"
[upload]
max_tries = 9
when_behind = "skip"
[restore]
verify = "fast"
[runtime]
preemption_signals = ["SIGUSR1"]
max_workers = 3
"""


def test_toml_and_yaml_of_the_same_shape_load_the_same(tmp_path):
    toml = load_config(write(tmp_path, FULL), environ={})
    yaml_text = """
local: {dir: /data/ckpt, keep_last: 4}
remote:
  url: s3://bucket/run
  keep_last: 7
  storage_options: {endpoint_url: "http://127.0.0.1:9000"}
upload: {max_tries: 9, when_behind: skip}
restore: {verify: fast}
runtime: {preemption_signals: [SIGUSR1], max_workers: 3}
"""
    yaml = load_config(write(tmp_path, yaml_text, "ckpt.yaml"), environ={})
    assert toml.local == yaml.local and toml.remote == yaml.remote and toml.upload == yaml.upload
    assert toml.local.dir == Path("/data/ckpt") and toml.remote.url == "s3://bucket/run"
    assert toml.remote.storage_options == {"endpoint_url": "http://127.0.0.1:9000"}
    assert toml.upload.max_tries == 9 and toml.restore.verify == "fast"
    assert toml.runtime == yaml.runtime == RuntimeOptions(max_workers=3, preemption_signals=[signal.SIGUSR1])


def test_precedence_is_argument_then_environment_then_file_then_default(tmp_path):
    path = write(tmp_path, FULL)
    environ = {"TIERED_CKPT_REMOTE_URL": "gs://other/run", "TIERED_CKPT_LOCAL_KEEP_LAST": "9"}
    config = load_config(path, environ=environ, overrides={"local.keep_last": 11})
    assert config.remote.url == "gs://other/run"  # environment over file
    assert config.local.keep_last == 11  # argument over environment
    assert config.remote.keep_last == 7  # file over default
    assert config.upload.concurrency == 2  # default
    assert load_config(environ={"TIERED_CKPT_LOCAL_DIR": str(tmp_path)}).local.dir == tmp_path


@pytest.mark.parametrize(
    "text, problem",
    [
        ("[local]\ndir = 3\n", "key 'local.dir' must be a path, got int"),
        ("[local]\ndir = 'x'\nkeep_last = 0\n", "key 'local.keep_last' must be >= 1"),
        ("[local]\ndir = 'x'\nkeep_last = true\n", "key 'local.keep_last' must be int, got bool"),
        ("[local]\ndir = 'x'\nkeeplast = 2\n", "unknown key 'local.keeplast'"),
        ("[locals]\ndir = 'x'\n", "unknown table 'locals'"),
        ("[local]\nkeep_last = 2\n", "key 'local.dir' is required"),
        ("[local]\ndir = 'x'\n[remote]\nurl = 'nosuch://bucket'\n", "unsupported URL scheme 'nosuch'"),
        ("[local]\ndir = 'x'\n[remote]\nkeep_last = 2\n", "key 'remote.url' is required"),
        ("[local]\ndir = 'x'\n[upload]\nwhen_behind = 'later'\n", "must be one of \\['skip', 'wait'\\]"),
        ("[local]\ndir = 'x'\n[upload]\ndeadline_seconds = 0\n", "key 'upload.deadline_seconds' must be >= 0.001"),
        ("[local]\ndir = 'x'\n[restore]\nverify = 'none'\n", "key 'restore.verify' must be one of"),
        ("[local]\ndir = 'x'\n[verify]\nmode = 'fast'\n", "unknown table 'verify'"),
        ("[local]\ndir = 'x'\n[runtime]\npreemption_signals = ['SIGKILL']\n", "key 'runtime.preemption_signals' "),
        (
            "[local]\ndir = 'x'\n[remote]\nurl = 's3://b'\n[remote.storage_options]\nsecret = 'abc'\n",
            "holds a credential",
        ),
        (
            "[local]\ndir = 'x'\n[remote]\nurl = 's3://b'\n"
            "[remote.storage_options.client_kwargs]\naws_secret_access_key = 'abc'\n",
            "holds a credential",
        ),
        ("[local\ndir = 'x'\n", "not a valid TOML config"),
        ("[local]\ndir = 'x'\n[remote]\nurl = 's3://b/r'\nendpoint_url = 'minio:9000'\n", "must be an http:// or"),
        ("[local]\ndir = 'x'\n[remote]\nurl = 's3://b/r'\nendpoint_url = 'http://k:abc@h'\n", "not hold credentials"),
        (
            "[local]\ndir = 'x'\n[remote]\nurl = 'memory://b/r'\nendpoint_url = 'http://h'\n",
            "s3://, gs:// and az:// URLs",
        ),
    ],
)
def test_bad_config_names_the_file_and_the_key(tmp_path, text, problem):
    path = write(tmp_path, text)
    with pytest.raises(ConfigError, match=problem) as caught:
        load_config(path, environ={})
    assert str(path) in str(caught.value)
    assert "abc" not in str(caught.value)  # a credential's value is never echoed


def test_bad_environment_variable_is_named(tmp_path):
    path = write(tmp_path, FULL)
    with pytest.raises(ConfigError, match="TIERED_CKPT_LOCAL_KEEPLAST: no such config key"):
        load_config(path, environ={"TIERED_CKPT_LOCAL_KEEPLAST": "3"})
    with pytest.raises(ConfigError, match="TIERED_CKPT_UPLOAD_MAX_TRIES: expected an integer"):
        load_config(path, environ={"TIERED_CKPT_UPLOAD_MAX_TRIES": "2.5"})


def test_token_may_name_a_method_but_not_hold_a_secret(tmp_path):
    base = "[local]\ndir = 'x'\n[remote]\nurl = 'gs://b/run'\n[remote.storage_options]\n"
    assert load_config(write(tmp_path, base + "token = 'anon'\n"), environ={}).remote.storage_options == {
        "token": "anon"
    }
    with pytest.raises(ConfigError, match="remote.storage_options.token"):
        load_config(write(tmp_path, base + "token = 'ya29.secret-looking'\n"), environ={})


def test_missing_file_is_a_config_error(tmp_path):
    with pytest.raises(ConfigError, match="cannot read the config"):
        load_config(tmp_path / "nope.toml", environ={})


def test_manager_from_config_uses_the_bucket_and_retention(tmp_path, s3_url, states):
    url, options = s3_url
    path = write(
        tmp_path,
        f"[local]\ndir = '{tmp_path / 'local'}'\nkeep_last = 1\n[remote]\nurl = '{url}'\n[restore]\nverify = 'fast'\n"
        f"[runtime]\nsharded_keys = {list(ZERO1_SHARDED_KEYS)!r}\n",
    )
    config = load_config(path, environ={})
    remote = replace(config.remote, storage_options=options)  # the test's credentials: never in a config
    with CheckpointManager.from_config(config, world_size=4, remote=remote) as manager:
        assert manager.root == tmp_path / "local" and manager.options.local.keep_last == 1
        assert manager.options.restore.verify == "fast"
        assert manager.options.runtime.sharded_keys == tuple(ZERO1_SHARDED_KEYS)
        manager.save(1, states)
        manager.wait(uploaded=True)
        assert manager.remote_steps() == [1]
        assert_states_equal(states, manager.restore().states)


@pytest.mark.parametrize(
    "key", ["account_key", "sas_token", "connection_string", "credential", "private_key", "passphrase", "Password"]
)
def test_credentials_are_refused_by_pattern_without_echoing_them(tmp_path, key):
    base = "[local]\ndir = 'x'\n[remote]\nurl = 'gs://b/run'\n[remote.storage_options]\n"
    with pytest.raises(ConfigError, match=f"remote.storage_options.{key}' holds a credential") as caught:
        load_config(write(tmp_path, base + f"{key} = 'hunter2-secret'\n"), environ={})
    assert "hunter2" not in str(caught.value)


@pytest.mark.parametrize("token", ["token = { refresh = 'hunter2-secret' }\n", "token = ['hunter2-secret']\n"])
def test_a_token_given_as_a_table_or_list_is_refused_typed(tmp_path, token):
    base = "[local]\ndir = 'x'\n[remote]\nurl = 'gs://b/run'\n[remote.storage_options]\n"
    with pytest.raises(ConfigError, match="storage_options.token' holds a credential") as caught:
        load_config(write(tmp_path, base + token), environ={})
    assert "hunter2" not in str(caught.value)


def test_storage_options_that_are_not_a_table_are_refused_without_echoing_them(tmp_path):
    text = "[local]\ndir = 'x'\n[remote]\nurl = 's3://b/run'\nstorage_options = 'hunter2-secret'\n"
    with pytest.raises(ConfigError, match="must be a table, got str") as caught:
        load_config(write(tmp_path, text), environ={})
    assert "hunter2" not in str(caught.value)


@pytest.mark.parametrize("url", ["s3://", "gs://", "memory://", ""])
def test_a_remote_url_without_a_bucket_is_a_config_error(tmp_path, url):
    with pytest.raises(ConfigError, match="key 'remote.url' .* names no bucket or directory"):
        load_config(write(tmp_path, f"[local]\ndir = 'x'\n[remote]\nurl = '{url}'\n"), environ={})


@pytest.mark.parametrize("scheme", [pytest.param("s3", marks=pytest.mark.slow), "gcs", "azure"])
def test_endpoint_url_from_a_config_or_the_environment_reaches_the_store(tmp_path, request, scheme, monkeypatch):
    from support.stores import AZURITE_ACCOUNT, AZURITE_KEY, S3_TEST_KEY, S3_TEST_SECRET

    url, options = request.getfixturevalue(f"{scheme}_url")
    endpoint = options["endpoint_url"] if scheme != "s3" else options["client_kwargs"]["endpoint_url"]
    with CheckpointManager(tmp_path / "job", world_size=1, remote=RemoteOptions(url, storage_options=options)) as m:
        manager = m
        manager.save(1, [{"w": np.arange(3.0)}])
        manager.wait(uploaded=True)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", S3_TEST_KEY)  # the store's own chain, not the config
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", S3_TEST_SECRET)
    monkeypatch.setenv("AZURE_STORAGE_ACCOUNT_KEY", AZURITE_KEY)
    storage = {
        "gcs": "[remote.storage_options]\nproject = 'test'\ntoken = 'anon'\n",
        "azure": f"[remote.storage_options]\naccount_name = '{AZURITE_ACCOUNT}'\n",
        "s3": "[remote.storage_options.client_kwargs]\nregion_name = 'us-east-1'\n",
    }[scheme]
    given = write(tmp_path, f"[local]\ndir = 'x'\n[remote]\nurl = '{url}'\nendpoint_url = '{endpoint}'\n{storage}")
    unnamed = write(tmp_path, f"[local]\ndir = 'x'\n[remote]\nurl = '{url}'\n{storage}", "unnamed.toml")
    for config in (
        load_config(given, environ={}),
        load_config(unnamed, environ={"TIERED_CKPT_REMOTE_ENDPOINT_URL": endpoint}),
        load_config(
            given,
            environ={"TIERED_CKPT_REMOTE_ENDPOINT_URL": "http://wrong:9"},
            overrides={"remote.endpoint_url": endpoint},
        ),
    ):
        assert config.remote.endpoint_url == endpoint
        assert open_remote_tier(config.remote, config.upload).steps() == [1]


# One text per option for its TIERED_CKPT_ variable, and the value it stands for. Every field of
# every group is here (the test below checks it), so a new option gets a variable with it.
ENVIRONMENT = {
    ("local", "dir"): ("/data/ckpt", Path("/data/ckpt")),
    ("local", "keep_last"): ("none", None),
    ("local", "keep_every"): ("500", 500),
    ("local", "keep_best"): ("2", 2),
    ("local", "best_metric"): ("val_loss", "val_loss"),
    ("local", "best_mode"): ("max", "max"),
    ("local", "max_awaiting_upload"): ("4", 4),
    ("local", "every"): ("100", 100),
    ("remote", "url"): ("s3://b/run", "s3://b/run"),
    ("remote", "keep_last"): ("7", 7),
    ("remote", "keep_every"): ("none", None),
    ("remote", "keep_best"): ("3", 3),
    ("remote", "best_metric"): ("none", None),
    ("remote", "best_mode"): ("min", "min"),
    ("remote", "layout"): ("hashed", "hashed"),
    ("remote", "endpoint_url"): ("http://127.0.0.1:9000", "http://127.0.0.1:9000"),
    ("remote", "lease_seconds"): ("60", 60.0),
    ("remote", "orphan_age_seconds"): ("7200.5", 7200.5),
    ("remote", "other_owners"): ("refuse", "refuse"),
    ("remote", "every"): ("500", 500),
    ("remote", "compression"): ("zstd", "zstd"),
    ("upload", "concurrency"): ("3", 3),
    ("upload", "max_tries"): ("8", 8),
    ("upload", "backoff_seconds"): ("0.25", 0.25),
    ("upload", "max_backoff_seconds"): ("10", 10.0),
    ("upload", "max_seconds"): ("120", 120.0),
    ("upload", "timeout_seconds"): ("30", 30.0),
    ("upload", "max_pending"): ("5", 5),
    ("upload", "when_behind"): ("skip", "skip"),
    ("upload", "deadline_seconds"): ("none", None),
    ("upload", "part_bytes"): (str(16 << 20), 16 << 20),
    ("upload", "part_concurrency"): ("6", 6),
    ("restore", "verify"): ("fast", "fast"),
    ("runtime", "sharded_keys"): ("param, exp_avg", ("param", "exp_avg")),
    ("runtime", "max_workers"): ("2", 2),
    ("runtime", "writer_cpus"): ("0", frozenset({0})),
    ("runtime", "preemption_signals"): ("SIGTERM,usr1", (signal.SIGTERM, signal.SIGUSR1)),
    ("runtime", "host_memory_bytes"): ("8589934592", 8 << 30),
    ("runtime", "must_change"): ("optim, model/head", ("optim", "model/head")),
    ("runtime", "stale_saves"): ("error", "error"),
    ("runtime", "incremental"): ("false", False),
    ("peer", "every"): ("10", 10),
    ("peer", "max_bytes"): (str(1 << 30), 1 << 30),
    ("peer", "timeout_seconds"): ("5", 5.0),
    ("peer", "memory_dir"): ("/dev/shm/job-7", Path("/dev/shm/job-7")),
    ("peer", "nodes"): ("a, a,b,b", ("a", "a", "b", "b")),
}


def test_every_option_but_the_storage_options_table_has_a_variable_here():
    from tiered_ckpt.options import GROUPS

    every = {(group, each.name) for group, kind in GROUPS.items() for each in dataclasses.fields(kind)}
    assert every - set(ENVIRONMENT) == {("remote", "storage_options")}


@pytest.mark.parametrize("key", sorted(ENVIRONMENT))
def test_every_option_is_reachable_from_its_environment_variable(key):
    group, name = key
    text, value = ENVIRONMENT[key]
    if key == ("runtime", "writer_cpus") and 0 not in getattr(os, "sched_getaffinity", lambda _: {0})(0):
        pytest.skip("CPU 0 is not this process's")
    environ = {"TIERED_CKPT_LOCAL_DIR": "/data/x", "TIERED_CKPT_REMOTE_URL": "s3://b/x"}
    if name in ("keep_best", "best_metric"):  # the two go together, and keep_best needs keep_last
        prefix = f"TIERED_CKPT_{group.upper()}_"
        environ |= {f"{prefix}KEEP_BEST": "1", f"{prefix}BEST_METRIC": "loss", f"{prefix}KEEP_LAST": "1"}
        if text == "none":
            environ.pop(f"{prefix}KEEP_BEST")
    environ[f"TIERED_CKPT_{group.upper()}_{name.upper()}"] = text
    config = load_config(environ=environ)
    assert getattr(getattr(config, group), name) == value
    assert config.origins[f"{group}.{name}"] == f"environment (TIERED_CKPT_{group.upper()}_{name.upper()})"


@pytest.mark.parametrize(
    "name, text, problem",
    [
        ("TIERED_CKPT_RUNTIME_WRITER_CPUS", "0,x", "expected an integer, got 'x'"),
        ("TIERED_CKPT_RUNTIME_PREEMPTION_SIGNALS", "SIGKILL", "key 'runtime.preemption_signals' SIGKILL cannot"),
        ("TIERED_CKPT_UPLOAD_MAX_TRIES", "none", "expected an integer, got 'none'"),
        ("TIERED_CKPT_RUNTIME_INCREMENTAL", "maybe", "expected true or false, got 'maybe'"),
        ("TIERED_CKPT_REMOTE_STORAGE_OPTIONS", "{}", "remote.storage_options is a table; set it in a config"),
    ],
)
def test_a_bad_variable_is_refused_naming_it(name, text, problem):
    with pytest.raises(ConfigError, match=re.escape(problem)) as caught:
        load_config(environ={"TIERED_CKPT_LOCAL_DIR": "x", name: text})
    assert name in str(caught.value)


def test_a_peer_table_turns_the_peer_tier_on_and_none_leaves_it_off(tmp_path):
    path = tmp_path / "job.toml"
    path.write_text('[local]\ndir = "ckpt"\nevery = 100\n\n[peer]\nevery = 10\nnodes = ["a", "b"]\n')
    config = load_config(path, environ={})
    assert config.peer == PeerOptions(every=10, nodes=("a", "b"))
    assert config.local.every == 100
    assert load_config(environ={"TIERED_CKPT_LOCAL_DIR": "x"}).peer is None
    assert load_config(environ={"TIERED_CKPT_LOCAL_DIR": "x", "TIERED_CKPT_PEER_EVERY": "5"}).peer.every == 5


def test_a_bad_peer_value_names_its_file_and_key(tmp_path):
    path = tmp_path / "job.yaml"
    path.write_text("local: {dir: ckpt}\npeer: {timeout_seconds: 0}\n")
    with pytest.raises(ConfigError, match=re.escape(f"{path}: key 'peer.timeout_seconds' must be >= 0.001")):
        load_config(path, environ={})
