"""The options dataclasses (tiered_ckpt.options): each refuses a bad field with a ConfigError naming
it (``field``, ``problem``, and the message starting with the field), keeps a good one, and never
shows a credential in its repr or its errors."""

import dataclasses
import math
import os
import re
import signal
from dataclasses import fields, replace
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from support.memory_tier import MemoryTier
from tiered_ckpt.config import load_config
from tiered_ckpt.errors import ConfigError, UsageError
from tiered_ckpt.format.bounds import MAX_COUNT, MAX_PART_BYTES, MAX_SECONDS
from tiered_ckpt.options import (
    GROUPS,
    LocalOptions,
    Options,
    PeerOptions,
    RemoteOptions,
    RestoreOptions,
    RuntimeOptions,
    TierOptions,
    UploadOptions,
    resolve_options,
)
from tiered_ckpt.tiers.remote.leases import OwnershipPolicy
from tiered_ckpt.tiers.remote.retry import RetryPolicy
from tiered_ckpt.tiers.retention import RetentionPolicy

URL = "memory://bucket/run"
SECRET = "hunter2-very-secret"
FEW = settings(max_examples=25)  # many fields, each with its own property: keep the file fast


COMPANIONS = {"keep_best": {"best_metric": "loss", "keep_last": 1}}  # fields an option needs beside it


def build(kind, **fields):
    for name in [name for name in COMPANIONS if name in fields]:
        fields = COMPANIONS[name] | fields
    if kind is LocalOptions:
        return LocalOptions(fields.pop("dir", "/tmp/ckpt"), **fields)
    if kind is RemoteOptions:
        return RemoteOptions(fields.pop("url", URL), **fields)
    return kind(**fields)


def refused(kind, name, value):
    """The ConfigError ``kind`` raises for ``name=value``, checked to name the field."""
    with pytest.raises(ConfigError) as caught:
        build(kind, **{name: value})
    error = caught.value
    assert isinstance(error, ValueError)  # a ConfigError is also a ValueError
    assert error.field == name and error.problem and str(error) == f"{name} {error.problem}"
    return error


not_a_number = st.one_of(st.text(max_size=5), st.booleans(), st.none(), st.lists(st.integers(), max_size=2))
not_an_int = st.one_of(not_a_number, st.floats(allow_nan=True))

# field -> (smallest value allowed, int only, None allowed)
UPLOAD_NUMBERS = {
    "concurrency": (1, True, False),
    "max_tries": (1, True, False),
    "backoff_seconds": (0, False, False),
    "max_backoff_seconds": (0, False, False),
    "max_seconds": (0, False, False),
    "timeout_seconds": (0.001, False, False),
    "max_pending": (1, True, False),
    "deadline_seconds": (0.001, False, True),
    "part_bytes": (5 << 20, True, False),
    "part_concurrency": (1, True, False),
}
# (group, field) -> the largest value it takes, for every numeric option (the seconds' is MAX_SECONDS)
BOUNDS = {
    (kind, each.name): MAX_PART_BYTES if each.name == "part_bytes" else MAX_COUNT
    for kind in GROUPS.values()
    for each in fields(kind)
    if str(each.type) in ("int", "int | None")
} | {
    (kind, each.name): MAX_SECONDS
    for kind in GROUPS.values()
    for each in fields(kind)
    if str(each.type) in ("float", "float | None")
}
KEEPS = {LocalOptions: ("keep_last", "keep_every", "max_awaiting_upload"), RemoteOptions: ("keep_last", "keep_every")}
KEEP_FIELDS = [(kind, name) for kind, names in KEEPS.items() for name in names]


# -- numbers ---------------------------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(UPLOAD_NUMBERS))
@FEW
@given(data=st.data())
def test_an_upload_number_below_its_minimum_is_refused_and_one_at_or_above_is_kept(name, data):
    minimum, integer, _ = UPLOAD_NUMBERS[name]
    low = (
        st.integers(max_value=math.ceil(minimum) - 1)
        if integer
        else st.floats(max_value=minimum, exclude_max=True, allow_infinity=False)
    )
    error = refused(UploadOptions, name, data.draw(low, "low"))
    assert f">= {minimum}" in error.problem
    high = st.integers(minimum, BOUNDS[UploadOptions, name]) if integer else st.floats(minimum, MAX_SECONDS)
    value = data.draw(high, "high")
    assert getattr(UploadOptions(**{name: value}), name) == value


@pytest.mark.parametrize("name", sorted(UPLOAD_NUMBERS))
@FEW
@given(value=not_a_number)
def test_an_upload_number_of_another_type_is_refused(name, value):
    _, _, none_allowed = UPLOAD_NUMBERS[name]
    if value is None and none_allowed:
        assert getattr(UploadOptions(**{name: None}), name) is None
        return
    refused(UploadOptions, name, value)


@pytest.mark.parametrize("name", sorted(n for n, (_, integer, _) in UPLOAD_NUMBERS.items() if integer))
@FEW
@given(value=st.floats(1, 1e12))
def test_a_count_given_as_a_float_is_refused_even_a_whole_one(name, value):
    assert "must be int, got float" in refused(UploadOptions, name, value).problem


@pytest.mark.parametrize("name", sorted(n for n, (_, integer, _) in UPLOAD_NUMBERS.items() if not integer))
@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf])
def test_seconds_that_are_nan_or_infinite_are_refused(name, value):
    refused(UploadOptions, name, value)


@pytest.mark.parametrize("kind, name", KEEP_FIELDS)
@FEW
@given(value=st.one_of(st.integers(max_value=0), not_an_int.filter(lambda v: v is not None)))
def test_a_keep_count_that_is_not_a_positive_int_is_refused(kind, name, value):
    assert "(or None: keep all)" in refused(kind, name, value).problem


@pytest.mark.parametrize("kind, name", KEEP_FIELDS)
@FEW
@given(value=st.one_of(st.none(), st.integers(1, 10**6)))
def test_a_keep_count_is_kept_and_reaches_the_retention_policy(kind, name, value):
    options = build(kind, **{name: value})
    assert getattr(options, name) == getattr(options.retention, name) == value
    assert isinstance(options.retention, RetentionPolicy)


@pytest.mark.parametrize(
    "name, minimum", [("lease_seconds", 1), pytest.param("orphan_age_seconds", 0, marks=pytest.mark.slow)]
)
@FEW
@given(data=st.data())
def test_ownership_seconds_are_checked_where_the_remote_options_are_made(name, minimum, data):
    bad = data.draw(st.one_of(st.floats(max_value=minimum, exclude_max=True), st.just(math.nan), not_a_number))
    refused(RemoteOptions, name, bad)
    good = data.draw(st.floats(minimum, 1e9))
    options = RemoteOptions(URL, **{name: good})
    assert getattr(options.ownership, name) == good and isinstance(options.ownership, OwnershipPolicy)


GROUP_OF = {kind: group for group, kind in GROUPS.items()}


def above(kind, name):
    """Numbers above the bound of option ``name``: the ones each consumer used to fail on among them."""
    maximum = BOUNDS[kind, name]
    if maximum != MAX_SECONDS:
        return st.one_of(st.integers(min_value=maximum + 1), st.just(10**400))
    floats = st.floats(min_value=maximum, exclude_min=True, allow_infinity=False)
    return st.one_of(floats, st.integers(min_value=int(maximum) + 1), st.sampled_from([10**400, 1e300, 1e14]))


def test_every_numeric_option_has_a_bound():
    expected = {"local": 5, "remote": 6, "upload": 10, "runtime": 2, "peer": 3}  # every int and float field
    assert {group: sum(GROUP_OF[kind] == group for kind, _ in BOUNDS) for group in expected} == expected


@pytest.mark.parametrize("kind, name", sorted(BOUNDS, key=lambda key: (GROUP_OF[key[0]], key[1])))
@settings(max_examples=25, deadline=None)  # loads a config per example: no per-example time limit on a busy machine
@given(data=st.data())
def test_a_number_above_its_bound_is_refused_naming_the_field_by_the_option_and_by_load_config(kind, name, data):
    value = data.draw(above(kind, name), "value")
    error = refused(kind, name, value)
    assert error.problem.startswith("must be <= ") and len(str(error)) < 200, error
    key = f"{GROUP_OF[kind]}.{name}"
    overrides = {"local.dir": "/ckpt", key: value} | ({"remote.url": URL} if kind is RemoteOptions else {})
    with pytest.raises(ConfigError, match=f"^override {re.escape(repr(key))}: key '{re.escape(key)}' must be <="):
        load_config(overrides=overrides, environ={})
    maximum = BOUNDS[kind, name]
    assert getattr(build(kind, **{name: maximum}), name) == maximum  # the bound itself is taken


# -- choices ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kind, name, good",
    [
        (UploadOptions, "when_behind", ("wait", "skip")),
        (RemoteOptions, "layout", ("auto", "flat", "hashed")),
        (RemoteOptions, "other_owners", ("warn", "refuse")),
        (RemoteOptions, "compression", ("none", "zstd")),
        (RestoreOptions, "verify", ("full", "fast")),
    ],
)
@FEW
@given(value=st.one_of(st.text(max_size=8), st.integers(), st.none(), st.booleans()))
def test_a_choice_outside_its_list_is_refused_naming_the_choices(kind, name, good, value):
    if value in good:
        assert getattr(build(kind, **{name: value}), name) == value
        return
    error = refused(kind, name, value)
    assert all(repr(choice) in error.problem for choice in good)


# -- the local directory -------------------------------------------------------------------------


@pytest.mark.parametrize("value", ["", None, 3, b"/tmp/x", ["/tmp"]])
def test_a_local_dir_that_is_not_a_path_is_refused(value):
    refused(LocalOptions, "dir", value)


def test_a_local_dir_becomes_a_path_with_the_home_directory_expanded():
    assert LocalOptions("~/ckpt").dir == Path.home() / "ckpt"
    assert LocalOptions(Path("/data/run")).dir == Path("/data/run")


# -- the remote URL and endpoint -------------------------------------------------------------------


@pytest.mark.parametrize(
    "url, problem",
    [
        ("s3://", "names no bucket or directory"),
        ("gs:///", "names no bucket or directory"),
        ("nosuchscheme://bucket/run", "unsupported URL scheme 'nosuchscheme'"),
        (3, "must be str"),
        (None, "must be str"),
    ],
)
def test_a_remote_url_fsspec_cannot_use_is_refused(url, problem):
    assert problem in refused(RemoteOptions, "url", url).problem


@pytest.mark.parametrize("url", ["memory://bucket/run", "s3://bucket/run", "gs://bucket", "file:///data/b", "/data/b"])
def test_a_usable_remote_url_is_kept(url):
    assert RemoteOptions(url).url == url


@pytest.mark.parametrize(
    "url", [f"s3://AKIAEXAMPLE:{SECRET}@bucket/run", f"ftp://admin:{SECRET}@127.0.0.1/run", f"gs://u:{SECRET}@b"]
)
def test_a_remote_url_holding_a_password_is_refused_without_showing_it(url):
    error = refused(RemoteOptions, "url", url)
    assert SECRET not in str(error) and "AKIAEXAMPLE" not in str(error) and "admin" not in str(error)


def test_a_remote_url_holding_a_password_is_refused_from_a_config_file_or_variable_naming_it(tmp_path):
    from tiered_ckpt import load_config

    url = f"s3://AKIAEXAMPLE:{SECRET}@bucket/run"
    path = tmp_path / "run.toml"
    path.write_text(f"[local]\ndir = 'x'\n[remote]\nurl = '{url}'\n")
    with pytest.raises(ConfigError, match=f"{path}: key 'remote.url' must not hold a user and password") as caught:
        load_config(path, environ={})
    assert SECRET not in str(caught.value)
    with pytest.raises(ConfigError, match=r"TIERED_CKPT_REMOTE_URL.*must not hold a user") as caught:
        load_config(None, environ={"TIERED_CKPT_REMOTE_URL": url, "TIERED_CKPT_LOCAL_DIR": str(tmp_path)})
    assert SECRET not in str(caught.value)


def test_an_at_sign_in_a_path_is_no_password():
    assert RemoteOptions("file:///data/run@2:b").url == "file:///data/run@2:b"
    assert RemoteOptions("s3://bucket/a:b@c").url == "s3://bucket/a:b@c"


@pytest.mark.parametrize(
    "endpoint, problem",
    [
        ("ftp://minio:9000", "must be an http:// or https:// URL"),
        ("http://", "names no host"),
        (9000, "must be str"),
        (f"https://admin:{SECRET}@minio:9000", "must not hold credentials"),
        (f"admin:{SECRET}@minio:9000", "must not hold credentials"),
    ],
)
def test_a_bad_endpoint_url_is_refused_without_showing_it(endpoint, problem):
    error = refused(RemoteOptions, "endpoint_url", endpoint)
    assert problem in error.problem and SECRET not in str(error)


def test_an_endpoint_url_is_only_for_s3_gcs_and_azure():
    assert "applies to s3://, gs:// and az:// URLs only" in refused(RemoteOptions, "endpoint_url", "http://h:1").problem
    for url in ("s3://b/run", "gs://b/run", "az://container/run", "abfs://container/run"):
        assert RemoteOptions(url, endpoint_url="http://127.0.0.1:9000").endpoint_url == "http://127.0.0.1:9000"


@pytest.mark.parametrize("value", [[("key", SECRET)], SECRET, 3])
def test_storage_options_that_are_not_a_table_are_refused_without_showing_them(value):
    error = refused(RemoteOptions, "storage_options", value)
    assert SECRET not in str(error)


# -- credentials never shown ------------------------------------------------------------------------


@FEW
@given(
    options=st.dictionaries(
        st.sampled_from(["key", "secret", "token", "password", "client_kwargs", "aws_session_token"]),
        st.just(SECRET),
        min_size=1,
    )
)
def test_the_repr_of_remote_options_and_of_everything_holding_them_never_shows_storage_options(options):
    remote = RemoteOptions("s3://bucket/run", storage_options=options, endpoint_url="http://127.0.0.1:9000")
    everything = Options(LocalOptions("/tmp/ckpt"), remote, UploadOptions(), RestoreOptions(), RuntimeOptions())
    for shown in (repr(remote), str(remote), repr(everything), repr(replace(remote, keep_last=2))):
        assert SECRET not in shown and "storage_options" not in shown
    assert dict(remote.storage_options) == options  # kept, only not shown


def test_a_refused_field_of_remote_options_never_shows_the_storage_options():
    with pytest.raises(ConfigError) as caught:
        RemoteOptions("s3://bucket/run", storage_options={"secret": SECRET}, layout="spiral")
    assert SECRET not in str(caught.value) and caught.value.field == "layout"


# -- derived policies -------------------------------------------------------------------------------


def test_upload_options_make_the_retry_policy_of_every_remote_request():
    upload = UploadOptions(max_tries=7, backoff_seconds=0.25, max_backoff_seconds=4, max_seconds=9, timeout_seconds=3)
    assert upload.retry == RetryPolicy(
        max_tries=7, backoff_seconds=0.25, max_backoff_seconds=4, max_seconds=9, timeout_seconds=3
    )


def test_local_options_protect_at_most_max_awaiting_upload_steps():
    assert LocalOptions("/tmp/ckpt", keep_last=2, max_awaiting_upload=5).retention == RetentionPolicy(2, None, 5)
    assert RemoteOptions(URL, keep_last=4).retention == RetentionPolicy(4, None, None)


def test_options_are_frozen():
    with pytest.raises(AttributeError):
        UploadOptions().max_tries = 0  # type: ignore[misc]


# -- the runtime ------------------------------------------------------------------------------------

LINUX = pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="thread affinity is Linux's")


def test_runtime_options_default_to_nothing_pinned_no_signal_and_sharded_keys_found_by_shape():
    assert RuntimeOptions() == RuntimeOptions(None, None, None, ())


@pytest.mark.parametrize(
    "given, kept",
    [
        (["b", "a"], ("b", "a")),
        ([("optim", "state", 0), ["model", "w"]], (("optim", "state", 0), ("model", "w"))),
        ((), ()),
    ],
)
def test_sharded_keys_are_kept_as_names_and_paths_of_tuples(given, kept):
    assert RuntimeOptions(sharded_keys=given).sharded_keys == kept


@pytest.mark.parametrize("value", ["model.w", b"w", 3, [3], [("a", 1.5)], [("a", True)], [()]])
def test_sharded_keys_that_are_not_names_or_paths_are_refused(value):
    refused(RuntimeOptions, "sharded_keys", value)


@pytest.mark.parametrize("value", [0, -1, 1.0, "2", True])
def test_max_workers_below_one_or_not_an_int_is_refused(value):
    refused(RuntimeOptions, "max_workers", value)


@LINUX
def test_writer_cpus_this_process_may_use_are_taken_as_a_set():
    allowed = os.sched_getaffinity(0)
    assert RuntimeOptions(writer_cpus=[min(allowed), min(allowed)]).writer_cpus == frozenset({min(allowed)})
    assert RuntimeOptions(writer_cpus=iter(allowed)).writer_cpus == frozenset(allowed)
    assert RuntimeOptions(writer_cpus=None).writer_cpus is None


@LINUX
@pytest.mark.parametrize("cpus", [[], set(), {10**6}, [0, 10**6], 3, "0", b"\x00", [-1], [True]])
def test_writer_cpus_that_cannot_be_used_are_refused(cpus):
    refused(RuntimeOptions, "writer_cpus", cpus)


@pytest.mark.parametrize(
    "given, kept",
    [
        (["SIGTERM"], (signal.SIGTERM,)),
        (["term", " usr1 "], (signal.SIGTERM, signal.SIGUSR1)),
        ([str(int(signal.SIGTERM))], (signal.SIGTERM,)),  # a number as a variable's text
        ([int(signal.SIGUSR2), signal.SIGUSR2], (signal.SIGUSR2,)),
        ((), ()),
    ],
)
def test_preemption_signals_are_taken_by_number_or_name_once_each(given, kept):
    assert RuntimeOptions(preemption_signals=given).preemption_signals == kept


@pytest.mark.parametrize("bad", [signal.SIGKILL, "SIGSTOP", 0, 10_000, "NOPE", True, 1.5])
def test_preemption_signals_that_cannot_be_caught_are_refused(bad):
    refused(RuntimeOptions, "preemption_signals", [bad])


def test_preemption_signals_as_one_string_are_refused_not_spelled_out():
    refused(RuntimeOptions, "preemption_signals", "SIGTERM")


# -- what the manager takes ---------------------------------------------------------------------------


def test_a_path_stands_for_local_options_and_a_url_for_remote_options():
    options = resolve_options("/tmp/ckpt", URL)
    assert options == Options(LocalOptions("/tmp/ckpt"), RemoteOptions(URL))
    assert resolve_options(Path("/tmp/ckpt")).remote is None


def test_the_groups_given_are_the_ones_used_and_the_others_default():
    local, remote = LocalOptions("/tmp/ckpt", keep_last=1), RemoteOptions(URL, keep_last=2)
    upload, restore, runtime = UploadOptions(max_tries=9), RestoreOptions("fast"), RuntimeOptions(max_workers=2)
    assert resolve_options(local, remote, upload, restore, runtime) == Options(local, remote, upload, restore, runtime)
    assert resolve_options(local) == Options(local, None, UploadOptions(), RestoreOptions(), RuntimeOptions())


@pytest.mark.parametrize(
    "arguments, name",
    [
        ((3,), "local"),
        (("/tmp/ckpt", 3), "remote"),
        (("/tmp/ckpt", None, RestoreOptions()), "upload"),
        (("/tmp/ckpt", None, None, UploadOptions()), "restore"),
        (("/tmp/ckpt", None, None, None, {"max_workers": 2}), "runtime"),
    ],
)
def test_an_argument_of_the_wrong_kind_is_a_usage_error_naming_it(arguments, name):
    with pytest.raises(UsageError, match=f"^argument {name} must be"):
        resolve_options(*arguments)


def test_a_bad_path_or_url_names_the_argument_and_keeps_the_field():
    with pytest.raises(ConfigError, match="^argument local: dir") as caught:
        resolve_options("")
    assert caught.value.field == "dir"
    with pytest.raises(ConfigError, match="^argument remote: url") as caught:
        resolve_options("/tmp/ckpt", "s3://")
    assert caught.value.field == "url"


# -- one name per option: the docstrings say every field -----------------------------------------------


@pytest.mark.parametrize("group", sorted(GROUPS))
def test_every_field_of_a_group_is_named_in_its_docstring(group):
    kind = GROUPS[group]
    documented = set(re.findall(r"``(\w+)", kind.__doc__ or ""))
    missing = [each.name for each in fields(kind) if each.name not in documented]
    assert not missing, f"{kind.__name__}'s docstring does not name {missing}"


def test_the_groups_are_the_fields_of_options_in_order():
    # ``tiers`` holds tier objects: the one field no config table gives
    assert list(GROUPS) == [each.name for each in fields(Options) if each.name != "tiers"]
    assert "tiers" not in GROUPS and fields(Options)[-1].name == "tiers"


def test_a_tier_of_the_callers_own_is_checked_where_it_is_given(tmp_path):
    tier = MemoryTier("cache")
    options = resolve_options(tmp_path, tiers=[TierOptions(tier, keep_last=2, every=3)])
    assert options.tiers[0].tier is tier and options.tiers[0].retention.keep_last == 2
    with pytest.raises(ConfigError, match="tier protocol"):
        TierOptions(object())
    with pytest.raises(ConfigError, match="a name the manager's own tiers take"):
        TierOptions(MemoryTier("remote"))
    with pytest.raises(ConfigError, match="every"):
        TierOptions(tier, every=0)
    with pytest.raises(UsageError, match="a list of TierOptions"):
        resolve_options(tmp_path, tiers=TierOptions(tier))
    with pytest.raises(UsageError, match=r"a name of its own, got \['cache', 'cache'\]"):
        resolve_options(tmp_path, tiers=[TierOptions(tier), TierOptions(MemoryTier("cache"))])


# -- the reference page --------------------------------------------------------------------------------

REFERENCE = Path(__file__).resolve().parent.parent / "docs" / "reference" / "options.md"


def reference_rows() -> dict[str, tuple[str, str]]:
    """``group.field`` -> (type, default) of each row of docs/reference/options.md's tables."""
    rows = {}
    for line in REFERENCE.read_text().splitlines():
        found = re.match(r"^\| `(\w+\.\w+)` \| `(.*?)` \| (.*?) \| .+ \|$", line)
        if found:
            name, kind, default = found.groups()
            assert name not in rows, f"{name} is listed twice"
            rows[name] = (kind.replace("\\|", "|"), default)
    return rows


def test_the_reference_lists_every_option_once_with_its_type_and_default():
    rows = reference_rows()
    expected = {}
    for group, kind in GROUPS.items():
        for each in fields(kind):
            if each.default is not dataclasses.MISSING:
                default = f"`{each.default!r}`"
            elif each.default_factory is not dataclasses.MISSING:
                default = f"`{each.default_factory()!r}`"
            else:
                default = "required"
            expected[f"{group}.{each.name}"] = (str(each.type), default)
    assert rows == expected


# --- the peer tier and the cadence of every tier ---------------------------------------------


@pytest.mark.parametrize(
    "field, value, problem",
    [
        ("every", 0, "every must be >= 1, got 0"),
        ("max_bytes", 0, "max_bytes must be >= 1, got 0"),
        ("max_bytes", 1.5, "max_bytes must be int, got float"),
        ("timeout_seconds", 0, "timeout_seconds must be >= 0.001"),
        ("memory_dir", "", "memory_dir must be a path"),
        ("nodes", "ab", "nodes must be a list of node names by rank"),
        ("nodes", ["a", ""], "nodes must be a non-empty list of node names"),
        ("nodes", [], "nodes must be a non-empty list of node names"),
    ],
)
def test_a_bad_peer_option_is_refused_naming_its_field(field, value, problem):
    with pytest.raises(ConfigError, match=re.escape(problem)) as caught:
        PeerOptions(**{field: value})
    assert caught.value.field == field


def test_peer_options_keep_nodes_as_a_tuple_and_the_memory_dir_as_a_path():
    options = PeerOptions(nodes=["a", "b"], memory_dir="~/shm")
    assert options.nodes == ("a", "b")
    assert options.memory_dir == Path("~/shm").expanduser()


def test_a_bucket_cadence_that_is_not_a_multiple_of_the_disks_is_refused():
    with pytest.raises(ConfigError, match=r"remote.every is 150, not a multiple of local.every \(100\)") as caught:
        resolve_options(LocalOptions("/x", every=100), RemoteOptions("s3://b/run", every=150))
    assert caught.value.field == "remote.every"
    assert resolve_options(LocalOptions("/x", every=100), RemoteOptions("s3://b/run", every=500)).remote.every == 500


def test_no_peer_group_is_no_peer_tier():
    assert resolve_options("/x").peer is None
    assert resolve_options("/x", peer=PeerOptions(every=10)).peer == PeerOptions(every=10)
    with pytest.raises(UsageError, match="argument peer must be PeerOptions or None"):
        resolve_options("/x", peer={"every": 10})
