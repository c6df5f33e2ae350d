"""The ``tiered-ckpt`` command line: its commands, their arguments and options, and its help.

:func:`build_parser` parses what :func:`tiered_ckpt.cli.main` is given; ``tiered-ckpt --help`` prints
``DESCRIPTION`` and ``EPILOG`` (plain text, since a terminal shows it as it is). What each
command does is :mod:`tiered_ckpt.cli`'s.
"""

from __future__ import annotations

import argparse
import os
import re
import signal
import sys
from collections.abc import Callable
from pathlib import Path

from tiered_ckpt import __version__
from tiered_ckpt.environment import ENV_PREFIX

__all__ = ["DESCRIPTION", "EPILOG", "EXIT_BROKEN_PIPE", "build_parser", "parse_size", "run_quietly"]

DESCRIPTION = """\
Look at, check and move the checkpoints of a tiered_ckpt job: a local directory and,
optionally, a bucket (s3://, gs://, or any fsspec URL).

ls, show, export, status and verify only read, and work while a job is training; pull, push and prune
lock the local directory as a running job does. The global options (--config,
--local-dir, --remote-url, --endpoint-url, --json) go before or after the command."""

EPILOG = f"""\
environment variables (used when no option names the value; a config file's value is
overridden by its variable, and both by an option):
  {ENV_PREFIX}LOCAL_DIR            the local directory (local.dir)
  {ENV_PREFIX}REMOTE_URL           the bucket, e.g. s3://bucket/run (remote.url)
  {ENV_PREFIX}REMOTE_ENDPOINT_URL  the S3, GCS or Azure endpoint, e.g. http://127.0.0.1:9000
                                    (remote.endpoint_url)
  {ENV_PREFIX}<TABLE>_<KEY>        any other config key, e.g. {ENV_PREFIX}LOCAL_KEEP_LAST=5
  AWS_ENDPOINT_URL, AWS_ENDPOINT_URL_S3
                                    honoured for s3:// when no endpoint is configured
                                    (botocore's own setting)
  AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY, AWS_PROFILE, GOOGLE_APPLICATION_CREDENTIALS
                                    credentials, read by the store's own chain (never
                                    from a config file)

exit codes:
  0    success
  1    a shard or manifest failed verification, or an operation failed (ls: the
       bucket could not be reached; the local steps are still listed)
  2    bad usage: an invalid option or config, or a local directory that does not
       exist (ls, status, show, export and verify --remote read the bucket alone
       when one is configured) or is a step directory
  141  the output's reader closed it early (| head); nothing more was printed"""


_SIZE = re.compile(r"(\d+)\s*([KMGT]i?B|B)?", re.IGNORECASE)


def parse_size(text: str) -> int:
    """``5GB`` (10**9), ``500MiB`` (2**20), ``1024`` (bytes) as a number of bytes >= 1."""
    match = _SIZE.fullmatch(text.strip())
    if match is None or int(match.group(1)) < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a size such as 5GB, 500MiB or 1048576")
    unit = (match.group(2) or "B").upper()
    power = "BKMGT".index(unit[0])
    return int(match.group(1)) * (1024 if "I" in unit else 1000) ** power


def _global_options(parser: argparse.ArgumentParser, *, top: bool) -> None:
    """The options every command takes, before or after it (after it, they win)."""
    default = None if top else argparse.SUPPRESS
    parser.add_argument("--config", type=Path, default=default, help="a TOML or YAML config file (see configs/)")
    parser.add_argument("--local-dir", default=default, help="the local directory (overrides local.dir)")
    parser.add_argument("--remote-url", default=default, help="the bucket, e.g. s3://bucket/run (overrides remote.url)")
    parser.add_argument(
        "--endpoint-url",
        default=default,
        help="the S3, GCS or Azure endpoint, e.g. http://127.0.0.1:9000 for MinIO (overrides remote.endpoint_url)",
    )
    parser.add_argument(
        "--json", action="store_true", default=False if top else argparse.SUPPRESS, help="print JSON (null: none)"
    )


def build_parser() -> argparse.ArgumentParser:
    """The parser of the ``tiered-ckpt`` command line: one subcommand per command, each taking
    the global options before or after it (``demo`` takes its own, parsed by the demo)."""
    parser = argparse.ArgumentParser(
        prog="tiered-ckpt",
        description=DESCRIPTION,
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    _global_options(parser, top=True)
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    def command(name: str, text: str) -> argparse.ArgumentParser:
        return commands.add_parser(
            name, help=text, description=text, epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter
        )

    _global_options(command("ls", "every step and its state in each tier"), top=False)
    _global_options(command("status", "how far the bucket is behind the local disk"), top=False)
    helps = [
        ("verify", "check every shard's sha256 in each tier"),
        ("pull", "fill the local directory from the bucket (created if missing)"),
        ("push", "upload what the bucket does not hold yet"),
    ]
    for name, text in helps:
        sub = command(name, text)
        sub.add_argument("step", type=int, nargs="?", help="one step (default: all, or the newest for pull)")
        if name == "verify":
            sub.add_argument(
                "--remote",
                action="store_true",
                help="the bucket only, by the store's own checksums where recorded (no download)",
            )
        _global_options(sub, top=False)
    show = command("show", "the arrays of one step: rank, name, dtype, shape and size")
    show.add_argument("step", type=int, help="the step")
    _global_options(show, top=False)
    diff = command("diff", "how two steps differ, array by array, from manifests and headers only")
    diff.add_argument("first", type=int, help="the earlier step")
    diff.add_argument("second", type=int, help="the later step")
    _global_options(diff, top=False)
    export = command("export", "write a step as a Hugging Face safetensors checkpoint, or a Lightning .ckpt")
    export.add_argument("step", type=int, help="the step")
    export.add_argument(
        "directory", help="where to write model*.safetensors (and the index); with --format lightning, the .ckpt file"
    )
    export.add_argument(
        "--format",
        choices=("safetensors", "lightning"),
        default="safetensors",
        help="safetensors (full tensors, default) or lightning: one .ckpt of a step the Lightning plugin saved",
    )
    export.add_argument(
        "--only", help="the part of the state to export: a top-level key (model) or a name as show lists it"
    )
    export.add_argument("--max-shard-size", type=parse_size, default=None, help="the largest file (default 5GB)")
    export.add_argument(
        "--full", action="store_true", help="lightning: the whole checkpoint, not its weights and hyper-parameters"
    )
    _global_options(export, top=False)
    prune = command("prune", "apply retention to both tiers")
    prune.add_argument("--dry-run", action="store_true", help="only say what would be deleted")
    _global_options(prune, top=False)
    commands.add_parser("demo", help="the demo: a run killed, a disk lost, a bit-exact resume", add_help=False)
    return parser


EXIT_BROKEN_PIPE = 128 + signal.SIGPIPE
"""What a shell reports for a tool that SIGPIPE ended."""


def run_quietly(command: Callable[[], int]) -> int:
    """``command()``'s exit code. A reader that closes the output early (``| head``) ends the
    command quietly with :data:`EXIT_BROKEN_PIPE`, as a Unix tool killed by SIGPIPE."""
    try:
        try:
            return command()
        finally:  # the output still buffered is written here, not at exit where a failure prints a traceback
            sys.stdout.flush()
    except BrokenPipeError:
        # Nothing more can reach the reader; stdout goes to /dev/null so that the interpreter's
        # own flush at exit finds nothing to fail on.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
        return EXIT_BROKEN_PIPE
