"""Configuration files: which local directory, which bucket, retention, uploads, verification.

A config is TOML (read with the standard library's ``tomllib``) or YAML (``yaml.safe_load``)
of this shape; every key is optional but ``local.dir``::

    [local]
    dir = "/nvme/ckpt"          # the fast local tier (a relative path is taken from the file's folder)
    keep_last = 3               # retention of local steps
    keep_every = 1000

    [remote]                    # the remote tier; leave out for local-only
    url = "s3://my-bucket/run-42"
    keep_last = 10
    keep_every = 5000
    endpoint_url = "http://127.0.0.1:9000"   # s3://, gs://, az:// only: another endpoint (MinIO, R2...)
    compression = "zstd"        # or "none" (the default): shard objects as they are

    [remote.storage_options]    # passed to fsspec as they are (endpoint, profile, region...)
    endpoint_url = "https://s3.example.com"

    [upload]                    # the uploader, and every request to the remote tier
    concurrency = 2
    max_tries = 5               # tries of one remote operation (a PUT and its check, a read...)
    backoff_seconds = 0.5
    max_seconds = 300           # no new try of an operation after this long
    timeout_seconds = 60        # a request with no answer fails after this long
    max_pending = 2
    when_behind = "wait"        # or "skip"

    [restore]
    verify = "full"             # or "fast" (xxh3-64 instead of sha256)

    [runtime]
    preemption_signals = ["SIGTERM"]
    writer_cpus = [3]

    [peer]                      # the peer tier (a partner's memory); leave out for none
    every = 10                  # copy every 10th saved step
    timeout_seconds = 30

Each table becomes the options dataclass of :mod:`tiered_ckpt.options` that checks its
values, and each key is one of its fields (``docs/reference/options.md`` lists them all);
this module only reads, merges and names where a value came from. Environment variables
``TIERED_CKPT_<TABLE>_<KEY>`` (``TIERED_CKPT_REMOTE_URL``, ``TIERED_CKPT_UPLOAD_MAX_TRIES``,
``TIERED_CKPT_RUNTIME_WRITER_CPUS=2,3`` ...) override the file, a list as comma-separated
items and ``none`` for an optional value left unset; ``remote.storage_options``, a table,
has no variable. Explicit overrides win over both.

YAML aliases (``*name``) are refused: a config is a few tables, and an alias is how a tiny
file expands into billions of values. Parsing is strict: an unknown table, key or
``TIERED_CKPT_`` variable, a value its option refuses (wrong type, out of range, nan or
infinity, a URL with an unsupported scheme or without a bucket), or a credential in
``storage_options`` raises :class:`ConfigError` naming the file (or variable) and the key.
Credentials come from the store's own chain (AWS environment or profile,
``GOOGLE_APPLICATION_CREDENTIALS``), never from a config.
"""

from __future__ import annotations

import dataclasses
import os
import tomllib
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from tiered_ckpt.environment import ENV_PREFIX
from tiered_ckpt.errors import ConfigError
from tiered_ckpt.options import (
    GROUPS,
    LocalOptions,
    PeerOptions,
    RemoteOptions,
    RestoreOptions,
    RuntimeOptions,
    UploadOptions,
)

__all__ = ["Config", "load_config", "ENV_PREFIX"]

# The names of keys that would put a secret in a config file (matched as parts of a key,
# so "aws_secret_access_key", "sas_token" and "private_key" are all caught); gcsfs's
# ``token`` may name a method instead.
_SECRET_WORDS = ("secret", "password", "passphrase", "credential", "token", "private", "account_key", "connection")
_SECRET_KEYS = {"key", "sas", "session"}
_TOKEN_METHODS = {"anon", "google_default", "cloud", "browser", "cache"}

_TABLES = GROUPS


@dataclass(frozen=True)
class Config:
    """A validated configuration; ``source`` names where it came from, and ``origins`` where
    each value that is not a default came from (``{"upload.when_behind": "configs/x.yaml"}``,
    or ``"environment (TIERED_CKPT_UPLOAD_WHEN_BEHIND)"``), and each table given where its
    first key came from (``{"peer": "environment (TIERED_CKPT_PEER_EVERY)"}``), for errors found later."""

    local: LocalOptions
    remote: RemoteOptions | None = None
    upload: UploadOptions = UploadOptions()
    restore: RestoreOptions = RestoreOptions()
    runtime: RuntimeOptions = RuntimeOptions()
    peer: PeerOptions | None = None
    source: str = "<defaults>"
    origins: Mapping[str, str] = dataclasses.field(default_factory=dict, repr=False, compare=False)

    def arguments(self, local: str | os.PathLike[str] | LocalOptions | None = None) -> dict[str, Any]:
        """The option groups as :class:`~tiered_ckpt.CheckpointManager` arguments, by group name.
        ``local`` replaces the config's: a path replaces ``local.dir`` only (e.g. one directory
        per rank under the config's), keeping the config's retention."""
        if isinstance(local, (str, os.PathLike)):
            local = dataclasses.replace(self.local, dir=Path(local))
        return {group: getattr(self, group) for group in GROUPS} | {"local": local or self.local}

    @contextmanager
    def naming_origins(self) -> Iterator[None]:
        """Around a use of this config's values: a :class:`ConfigError` about one of them (refused
        there, not by its own check) is raised again naming the file or variable it came from."""
        try:
            yield
        except ConfigError as exc:
            if exc.field is None or exc.field not in self.origins:
                raise
            raise ConfigError(f"{self.origins[exc.field]}: key '{exc.field}' {exc.problem}") from None


def _fields(table: str) -> dict[str, dataclasses.Field[Any]]:
    return {field.name: field for field in dataclasses.fields(_TABLES[table])}


def _is_secret(key: str, value: Any) -> bool:
    name = key.lower()
    if name == "token":
        return not (isinstance(value, str) and value in _TOKEN_METHODS)
    return name in _SECRET_KEYS or any(word in name for word in _SECRET_WORDS)


def _check_storage_options(options: Any, where: str) -> None:
    """Refuse ``options`` if a key anywhere in it (in tables, lists, lists of lists...) names a credential.

    Each container is walked once (a YAML document may share one many times; see
    :class:`_ConfigLoader`, which refuses aliases anyway).
    """
    if not isinstance(options, Mapping):
        # Never echo the value: it may be a secret.
        raise ConfigError(f"{where}: key 'remote.storage_options' must be a table, got {type(options).__name__}")
    seen: set[int] = set()
    pending: list[tuple[Any, str]] = [(options, "remote.storage_options")]
    while pending:
        value, name = pending.pop()
        if not isinstance(value, (Mapping, list, tuple)) or id(value) in seen:
            continue
        seen.add(id(value))
        if isinstance(value, Mapping):
            for key, item in value.items():
                if not isinstance(key, str):
                    raise ConfigError(f"{where}: key '{name}' has a key that is not a string")
                if _is_secret(key, item):
                    raise ConfigError(
                        f"{where}: key '{name}.{key}' holds a credential; configs never hold secrets "
                        "(use the store's own credential chain: environment, profile, GOOGLE_APPLICATION_CREDENTIALS)"
                    )
                pending.append((item, f"{name}.{key}"))
        else:
            pending.extend((item, f"{name}[{index}]") for index, item in enumerate(value))


class _ConfigLoader(yaml.SafeLoader):
    """``yaml.safe_load`` without aliases.

    A config is a few hand-written tables, which never need an anchor's copy; an alias is
    refused rather than expanded, so that a few hundred bytes of nested aliases (a "billion
    laughs") cannot make a checker or fsspec walk billions of values.
    """

    def compose_node(self, parent: Any, index: Any) -> Any:
        if self.check_event(yaml.AliasEvent):
            event = self.peek_event()
            raise ConfigError(
                f"line {event.start_mark.line + 1}: YAML aliases (*{event.anchor}) are not allowed in a config; "
                "write the value out"
            )
        return super().compose_node(parent, index)


def _read_document(path: Path) -> dict[str, Any]:
    try:
        raw = path.read_bytes()
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read the config: {exc}") from exc
    try:
        if path.suffix.lower() in (".yaml", ".yml"):
            document = yaml.load(raw.decode("utf-8"), Loader=_ConfigLoader) or {}  # noqa: S506 -- a SafeLoader
        else:
            document = tomllib.loads(raw.decode("utf-8"))
    except ConfigError as exc:
        raise ConfigError(f"{path}: {exc}") from None
    except (tomllib.TOMLDecodeError, yaml.YAMLError, UnicodeDecodeError) as exc:
        raise ConfigError(
            f"{path}: not a valid {'YAML' if path.suffix in ('.yaml', '.yml') else 'TOML'} config: {exc}"
        ) from exc
    if not isinstance(document, dict):
        raise ConfigError(f"{path}: a config must be a table of tables, got {type(document).__name__}")
    return document


def _env_value(name: str, text: str, field: dataclasses.Field[Any]) -> Any:
    """An environment variable's text as the type its option's field holds: a number, a list
    of comma-separated items (numbers where the field holds numbers), ``true``/``false`` (or
    1/0, yes/no) for a flag, ``none`` for None."""
    kind = str(field.type)
    if kind.endswith("| None") and text.strip().lower() in ("", "none"):
        return None
    if kind.startswith(("tuple", "frozenset")):
        items = [item.strip() for item in text.split(",") if item.strip()]
        return [_number(name, item, "int") for item in items] if "[int]" in kind else items
    if kind.startswith(("int", "float")):
        return _number(name, text, kind[:3])
    if kind == "bool":
        value = {"true": True, "1": True, "yes": True, "false": False, "0": False, "no": False}.get(
            text.strip().lower()
        )
        if value is None:
            raise ConfigError(f"environment variable {name}: expected true or false, got {text!r}")
        return value
    return text


def _number(name: str, text: str, kind: str) -> int | float:
    try:
        return int(text) if kind == "int" else float(text)
    except ValueError:
        expected = "an integer" if kind == "int" else "a number"
        raise ConfigError(f"environment variable {name}: expected {expected}, got {text!r}") from None


def _env_overrides(environ: Mapping[str, str]) -> dict[tuple[str, str], tuple[Any, str]]:
    overrides: dict[tuple[str, str], tuple[Any, str]] = {}
    for name, text in environ.items():
        if not name.startswith(ENV_PREFIX):
            continue
        table, _, key = name[len(ENV_PREFIX) :].lower().partition("_")
        fields = _fields(table) if table in _TABLES else {}
        if key == "storage_options" and table == "remote":
            raise ConfigError(f"environment variable {name}: remote.storage_options is a table; set it in a config")
        if key not in fields:
            raise ConfigError(f"environment variable {name}: no such config key")
        overrides[(table, key)] = (_env_value(name, text, fields[key]), f"environment ({name})")
    return overrides


def load_config(
    path: str | os.PathLike[str] | None = None,
    *,
    environ: Mapping[str, str] | None = None,
    overrides: Mapping[str, Any] | None = None,
) -> Config:
    """Load and validate a config: defaults < file < environment < ``overrides``.

    ``overrides`` maps ``table.key`` names to values: ``load_config(p, overrides={"remote.url":
    "s3://b/run", "local.keep_last": 5})``. ``environ`` defaults to ``os.environ``; without a
    file, ``TIERED_CKPT_LOCAL_DIR`` (or an override) names the directory. Raises
    :class:`ConfigError` naming the file or variable and the key.
    """
    source = str(path) if path is not None else "<no file>"
    merged: dict[tuple[str, str], tuple[Any, str]] = {}  # (table, key) -> (value, where it came from)
    if path is not None:
        for table, values in _read_document(Path(path)).items():
            if table not in _TABLES:
                raise ConfigError(f"{source}: unknown table '{table}'")
            if not isinstance(values, dict):
                raise ConfigError(f"{source}: '{table}' must be a table, got {type(values).__name__}")
            for key, value in values.items():
                if key not in _fields(table):
                    raise ConfigError(f"{source}: unknown key '{table}.{key}'")
                if (table, key) == ("local", "dir"):
                    value = _relative_to(Path(path), value)
                merged[(table, key)] = (value, source)
    merged.update(_env_overrides(os.environ if environ is None else environ))
    for name, value in (overrides or {}).items():
        table, _, key = name.partition(".")
        if table not in _TABLES or key not in _fields(table):
            raise ConfigError(f"override {name!r}: no such config key (a key is 'table.key', e.g. 'remote.url')")
        merged[(table, key)] = (value, f"override {name!r}")
    return _build(merged, source)


def _relative_to(config: Path, directory: Any) -> Any:
    """A relative ``local.dir`` of a config file is taken from the file's folder, as paths in
    configs usually are (the same file then names the same directory from any working directory)."""
    if not isinstance(directory, str) or not directory or Path(directory).expanduser().is_absolute():
        return directory  # the option's own check refuses what is not a path
    return config.absolute().parent / directory


def _options(table: str, merged: dict[tuple[str, str], tuple[Any, str]], source: str) -> Any:
    """The options of ``table`` from the merged values; a refused value names where it came from."""
    values = {key: value for (name, key), (value, _where) in merged.items() if name == table}
    try:
        return _TABLES[table](**values)
    except ConfigError as exc:
        if exc.field is None:
            raise
        where = merged.get((table, exc.field), (None, source))[1]
        raise ConfigError(f"{where}: key '{table}.{exc.field}' {exc.problem}") from None


def _build(merged: dict[tuple[str, str], tuple[Any, str]], source: str) -> Config:
    if ("local", "dir") not in merged:
        raise ConfigError(f"{source}: key 'local.dir' is required (or {ENV_PREFIX}LOCAL_DIR)")
    remote = None
    given = [(key, where) for (table, key), (_value, where) in merged.items() if table == "remote"]
    if given:
        if ("remote", "url") not in merged:
            key, where = given[0]
            raise ConfigError(f"{where}: key 'remote.url' is required when remote.{key} is given")
        if ("remote", "storage_options") in merged:
            value, where = merged[("remote", "storage_options")]
            _check_storage_options(value, where)
        remote = _options("remote", merged, source)
    return Config(
        local=_options("local", merged, source),
        remote=remote,
        upload=_options("upload", merged, source),
        restore=_options("restore", merged, source),
        runtime=_options("runtime", merged, source),
        peer=_options("peer", merged, source) if any(table == "peer" for table, _key in merged) else None,
        source=source,
        origins=_origins(merged),
    )


def _origins(merged: dict[tuple[str, str], tuple[Any, str]]) -> dict[str, str]:
    """Where each key's value came from, and each table's first key (what turned the table on)."""
    origins = {f"{table}.{key}": where for (table, key), (_value, where) in merged.items()}
    for (table, _key), (_value, where) in merged.items():
        origins.setdefault(table, where)
    return origins
