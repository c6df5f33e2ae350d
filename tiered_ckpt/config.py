"""Configuration files: which local directory, which bucket, retention, uploads, verification.

A config is TOML (read with the standard library's ``tomllib``) or YAML (``yaml.safe_load``)
of this shape; every key is optional but ``local.dir``::

    [local]
    dir = "/nvme/ckpt"          # the fast local tier
    keep_last = 3               # retention of local steps
    keep_every = 1000

    [remote]                    # the remote tier; leave out for local-only
    url = "s3://my-bucket/run-42"
    keep_last = 10
    keep_every = 5000

    [remote.storage_options]    # passed to fsspec as they are (endpoint, profile, region...)
    endpoint_url = "https://s3.example.com"

    [upload]
    concurrency = 2
    max_tries = 5
    backoff_seconds = 0.5
    max_pending = 2
    when_behind = "wait"        # or "skip"

    [verify]
    mode = "full"               # or "fast" (xxh3-64 instead of sha256)

Environment variables ``TIERED_CKPT_<TABLE>_<KEY>`` (``TIERED_CKPT_REMOTE_URL``,
``TIERED_CKPT_LOCAL_KEEP_LAST`` ...) override the file; explicit arguments override both.
Parsing is strict: an unknown table, key or ``TIERED_CKPT_`` variable, a wrong type, an
unsupported URL scheme or a credential in ``storage_options`` raises :class:`ConfigError`
naming the file (or variable) and the key. Credentials come from the store's own chain
(AWS environment or profile, ``GOOGLE_APPLICATION_CREDENTIALS``), never from a config.
"""

from __future__ import annotations

import os
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import fsspec
import yaml

from .errors import ConfigError

__all__ = ["Config", "LocalConfig", "RemoteConfig", "UploadConfig", "VerifyConfig", "load_config", "ENV_PREFIX"]

ENV_PREFIX = "TIERED_CKPT_"
# Keys that would put a secret in a config file; gcsfs's ``token`` may name a method instead.
_SECRET_KEYS = {
    "secret",
    "key",
    "password",
    "aws_secret_access_key",
    "aws_session_token",
    "session_token",
    "client_secret",
}
_TOKEN_METHODS = {"anon", "google_default", "cloud", "browser", "cache"}


@dataclass(frozen=True)
class LocalConfig:
    dir: Path
    keep_last: int | None = 3
    keep_every: int | None = None


@dataclass(frozen=True)
class RemoteConfig:
    url: str
    keep_last: int | None = None
    keep_every: int | None = None
    storage_options: Mapping[str, Any] = field(default_factory=dict, repr=False)


@dataclass(frozen=True)
class UploadConfig:
    concurrency: int = 2
    max_tries: int = 5
    backoff_seconds: float = 0.5
    max_pending: int = 2
    when_behind: str = "wait"


@dataclass(frozen=True)
class VerifyConfig:
    mode: str = "full"


@dataclass(frozen=True)
class Config:
    """A validated configuration; ``source`` names where it came from."""

    local: LocalConfig
    remote: RemoteConfig | None = None
    upload: UploadConfig = UploadConfig()
    verify: VerifyConfig = VerifyConfig()
    source: str = "<defaults>"

    def manager_kwargs(self) -> dict[str, Any]:
        """The :class:`~tiered_ckpt.CheckpointManager` arguments this config stands for."""
        kwargs: dict[str, Any] = {
            "keep_last": self.local.keep_last,
            "keep_every": self.local.keep_every,
            "upload_concurrency": self.upload.concurrency,
            "upload_max_tries": self.upload.max_tries,
            "upload_backoff_seconds": self.upload.backoff_seconds,
            "max_pending_uploads": self.upload.max_pending,
            "when_uploads_behind": self.upload.when_behind,
        }
        if self.remote is not None:
            kwargs.update(
                remote_url=self.remote.url,
                storage_options=dict(self.remote.storage_options),
                keep_last_remote=self.remote.keep_last,
                keep_every_remote=self.remote.keep_every,
            )
        return kwargs


_TABLES: dict[str, type] = {
    "local": LocalConfig,
    "remote": RemoteConfig,
    "upload": UploadConfig,
    "verify": VerifyConfig,
}
# What each key must hold: (types accepted, None allowed, minimum or allowed values).
_RULES: dict[tuple[str, str], tuple[tuple[type, ...], bool, Any]] = {
    ("local", "dir"): ((str,), False, None),
    ("local", "keep_last"): ((int,), True, 1),
    ("local", "keep_every"): ((int,), True, 1),
    ("remote", "url"): ((str,), False, None),
    ("remote", "keep_last"): ((int,), True, 1),
    ("remote", "keep_every"): ((int,), True, 1),
    ("remote", "storage_options"): ((dict,), False, None),
    ("upload", "concurrency"): ((int,), False, 1),
    ("upload", "max_tries"): ((int,), False, 1),
    ("upload", "backoff_seconds"): ((int, float), False, 0),
    ("upload", "max_pending"): ((int,), False, 1),
    ("upload", "when_behind"): ((str,), False, {"wait", "skip"}),
    ("verify", "mode"): ((str,), False, {"full", "fast"}),
}


def _check_value(table: str, key: str, value: Any, where: str) -> Any:
    rule = _RULES.get((table, key))
    if rule is None:
        raise ConfigError(f"{where}: unknown key '{table}.{key}'")
    types, nullable, constraint = rule
    name = f"'{table}.{key}'"
    if value is None and nullable:
        return None
    if isinstance(value, bool) or not isinstance(value, types):
        expected = " or ".join(t.__name__ for t in types)
        raise ConfigError(f"{where}: key {name} must be {expected}, got {type(value).__name__} {value!r:.60}")
    if isinstance(constraint, set) and value not in constraint:
        raise ConfigError(f"{where}: key {name} must be one of {sorted(constraint)}, got {value!r}")
    if isinstance(constraint, int) and value < constraint:
        raise ConfigError(f"{where}: key {name} must be >= {constraint}, got {value!r}")
    return value


def _check_url(url: str, where: str) -> None:
    scheme = url.split("://", 1)[0] if "://" in url else "file"
    if scheme not in fsspec.available_protocols():
        raise ConfigError(f"{where}: key 'remote.url' has unsupported URL scheme {scheme!r}")


def _check_storage_options(options: Mapping[str, Any], where: str) -> None:
    for key, value in options.items():
        if not isinstance(key, str):
            raise ConfigError(f"{where}: key 'remote.storage_options' has a non-string key {key!r}")
        if key.lower() in _SECRET_KEYS or (key == "token" and value not in _TOKEN_METHODS):
            raise ConfigError(
                f"{where}: key 'remote.storage_options.{key}' holds a credential; configs never hold secrets "
                "(use the store's own credential chain: environment, profile, GOOGLE_APPLICATION_CREDENTIALS)"
            )
        if isinstance(value, Mapping):
            _check_storage_options(value, where)


def _read_document(path: Path) -> dict[str, Any]:
    try:
        raw = path.read_bytes()
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read the config: {exc}") from exc
    try:
        if path.suffix.lower() in (".yaml", ".yml"):
            document = yaml.safe_load(raw.decode("utf-8")) or {}
        else:
            document = tomllib.loads(raw.decode("utf-8"))
    except (tomllib.TOMLDecodeError, yaml.YAMLError, UnicodeDecodeError) as exc:
        raise ConfigError(
            f"{path}: not a valid {'YAML' if path.suffix in ('.yaml', '.yml') else 'TOML'} config: {exc}"
        ) from exc
    if not isinstance(document, dict):
        raise ConfigError(f"{path}: a config must be a table of tables, got {type(document).__name__}")
    return document


def _env_overrides(environ: Mapping[str, str]) -> dict[str, dict[str, Any]]:
    overrides: dict[str, dict[str, Any]] = {}
    for name, text in environ.items():
        if not name.startswith(ENV_PREFIX):
            continue
        rest = name[len(ENV_PREFIX) :].lower()
        table, _, key = rest.partition("_")
        if (table, key) not in _RULES or key == "storage_options":
            raise ConfigError(f"environment variable {name}: no such config key")
        types = _RULES[(table, key)][0]
        value: Any = text
        if int in types or float in types:
            try:
                value = int(text) if int in types and text.strip().lstrip("-").isdigit() else float(text)
            except ValueError:
                raise ConfigError(f"environment variable {name}: expected a number, got {text!r}") from None
            if types == (int,) and isinstance(value, float):
                raise ConfigError(f"environment variable {name}: expected an integer, got {text!r}")
        overrides.setdefault(table, {})[key] = value
    return overrides


def load_config(
    path: str | os.PathLike[str] | None = None,
    *,
    environ: Mapping[str, str] | None = None,
    **overrides: Any,
) -> Config:
    """Load and validate a config: defaults < file < environment < ``overrides``.

    ``overrides`` use ``table_key`` names: ``load_config(p, remote_url="s3://b/run",
    local_keep_last=5)``. ``environ`` defaults to ``os.environ``. Raises
    :class:`ConfigError` naming the file or variable and the key.
    """
    source = str(path) if path is not None else "<no file>"
    merged: dict[str, dict[str, Any]] = {}
    if path is not None:
        for table, values in _read_document(Path(path)).items():
            if table not in _TABLES:
                raise ConfigError(f"{source}: unknown table '{table}'")
            if not isinstance(values, dict):
                raise ConfigError(f"{source}: '{table}' must be a table, got {type(values).__name__}")
            merged[table] = {key: _check_value(table, key, value, source) for key, value in values.items()}
    for table, values in _env_overrides(os.environ if environ is None else environ).items():
        merged.setdefault(table, {}).update(
            {
                key: _check_value(table, key, value, f"environment ({ENV_PREFIX}{table.upper()}_{key.upper()})")
                for key, value in values.items()
            }
        )
    for name, value in overrides.items():
        table, _, key = name.partition("_")
        if table not in _TABLES:
            raise ConfigError(f"argument {name}: no such config key")
        merged.setdefault(table, {})[key] = _check_value(table, key, value, f"argument {name}")
    return _build(merged, source)


def _build(merged: dict[str, dict[str, Any]], source: str) -> Config:
    local = merged.get("local", {})
    if "dir" not in local:
        raise ConfigError(f"{source}: key 'local.dir' is required (or {ENV_PREFIX}LOCAL_DIR)")
    remote = merged.get("remote")
    remote_config = None
    if remote:
        if "url" not in remote:
            raise ConfigError(f"{source}: key 'remote.url' is required when [remote] is given")
        _check_url(remote["url"], source)
        _check_storage_options(remote.get("storage_options", {}), source)
        remote_config = RemoteConfig(**remote)
    return Config(
        local=LocalConfig(**{**local, "dir": Path(local["dir"]).expanduser()}),
        remote=remote_config,
        upload=UploadConfig(**merged.get("upload", {})),
        verify=VerifyConfig(**merged.get("verify", {})),
        source=source,
    )
