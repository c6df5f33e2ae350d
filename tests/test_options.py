"""The options dataclasses (tiered_ckpt.options): each refuses a bad field with a ConfigError naming
it (``field``, ``problem``, and the message starting with the field), keeps a good one, and never
shows a credential in its repr or its errors."""

import math
from dataclasses import replace
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tiered_ckpt.errors import ConfigError, UsageError
from tiered_ckpt.options import (
    KEYWORDS,
    LocalOptions,
    Options,
    RemoteOptions,
    UploadOptions,
    VerifyOptions,
    resolve_options,
)
from tiered_ckpt.tiers.owners import OwnershipPolicy
from tiered_ckpt.tiers.retention import RetentionPolicy
from tiered_ckpt.tiers.retry import RetryPolicy

URL = "memory://bucket/run"
SECRET = "hunter2-very-secret"
FEW = settings(max_examples=25)  # many fields, each with its own property: keep the file fast


def build(kind, **fields):
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
    high = st.integers(minimum, 1 << 40) if integer else st.floats(minimum, 1e9)
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
    "name, minimum", [("lease_seconds", 1), ("orphan_age_seconds", 0)]
)  # fmt: skip
@FEW
@given(data=st.data())
def test_ownership_seconds_are_checked_where_the_remote_options_are_made(name, minimum, data):
    bad = data.draw(st.one_of(st.floats(max_value=minimum, exclude_max=True), st.just(math.nan), not_a_number))
    refused(RemoteOptions, name, bad)
    good = data.draw(st.floats(minimum, 1e9))
    options = RemoteOptions(URL, **{name: good})
    assert getattr(options.ownership, name) == good and isinstance(options.ownership, OwnershipPolicy)


# -- choices ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kind, name, good",
    [
        (UploadOptions, "when_behind", ("wait", "skip")),
        (RemoteOptions, "layout", ("flat", "hashed")),
        (RemoteOptions, "other_owners", ("warn", "refuse")),
        (VerifyOptions, "mode", ("full", "fast")),
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


def test_an_endpoint_url_is_only_for_s3_and_gcs():
    assert "applies to s3:// and gs:// URLs only" in refused(RemoteOptions, "endpoint_url", "http://h:1").problem
    for url in ("s3://b/run", "gs://b/run"):
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
    everything = Options(LocalOptions("/tmp/ckpt"), remote, UploadOptions(), VerifyOptions())
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


# -- keywords -------------------------------------------------------------------------------------


@pytest.mark.parametrize("keyword", sorted(KEYWORDS))
def test_every_keyword_sets_the_field_it_names(keyword):
    table, name = KEYWORDS[keyword]
    value = {
        "verify": "fast", "remote_url": "memory://b/other", "storage_options": {"anon": True},
        "when_uploads_behind": "skip", "remote_layout": "hashed", "upload_backoff_seconds": 2.5,
        "upload_deadline_seconds": 12.5,
    }.get(keyword, 6)  # fmt: skip
    options = resolve_options("/tmp/ckpt", RemoteOptions(URL), None, {keyword: value})
    assert getattr(getattr(options, table), name) == value


def test_a_bad_keyword_value_names_the_keyword_not_the_field():
    with pytest.raises(ConfigError) as caught:
        resolve_options("/tmp/ckpt", None, None, {"upload_max_tries": 0})
    assert caught.value.field == "upload_max_tries" and str(caught.value).startswith(
        "keyword argument upload_max_tries"
    )


def test_a_bad_local_dir_names_the_argument():
    with pytest.raises(ConfigError) as caught:
        resolve_options("", None, None, {})
    assert caught.value.field == "local_dir"


def test_an_unknown_keyword_is_a_usage_error_naming_its_close_matches_and_the_field_it_is():
    with pytest.raises(UsageError, match=r"keep_lats: did you mean keep_last") as caught:
        resolve_options("/tmp/ckpt", None, None, {"keep_lats": 1})
    assert "known: " in str(caught.value)
    with pytest.raises(UsageError, match=r"endpoint_url is a field of RemoteOptions"):
        resolve_options("/tmp/ckpt", None, None, {"endpoint_url": "http://h"})


def test_remote_url_none_removes_the_remote_and_a_url_alone_starts_one():
    assert resolve_options("/tmp/ckpt", RemoteOptions(URL), None, {"remote_url": None}).remote is None
    assert resolve_options("/tmp/ckpt", None, None, {"remote_url": URL}).remote == RemoteOptions(URL)
    assert resolve_options("/tmp/ckpt", None, None, {"keep_last_remote": 3}).remote is None
