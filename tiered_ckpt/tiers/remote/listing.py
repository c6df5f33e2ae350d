"""The remote tier's words for its steps' prefixes: where each is, and which the bucket holds.

A step's objects are under ``step-<12 digits>/`` of the tier's URL (see
:mod:`~tiered_ckpt.format.layout`), and a step is committed there exactly when its remote
manifest exists. A prefix without one that holds the mark ``kept-for-later-steps.json`` keeps
files that committed steps reference (a deleted step's, or one never committed there): it is
neither committed nor a half-uploaded step (see :mod:`~tiered_ckpt.tiers.remote.kept`).
:class:`BucketListing` is the part of :class:`~tiered_ckpt.tiers.remote.tier.RemoteTier` that
names those prefixes and lists them, each request under the tier's retry policy, tried on its own.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from typing import Any

from tiered_ckpt.errors import ManifestError, RemoteError
from tiered_ckpt.format.layout import KEPT_NAME, MANIFEST_NAME, parse_step_dir_name, step_dir_name
from tiered_ckpt.format.remote_manifest import RemoteManifest
from tiered_ckpt.io.parallel import run_parallel
from tiered_ckpt.tiers.remote.requests import Requests, is_missing

__all__ = ["BucketListing"]

# The checks of a listing's steps run this many at once: one after another, a bucket of a
# hundred steps made every restore wait a hundred first bytes.
CHECKS_AT_ONCE = 16


class BucketListing:
    """Step prefixes under ``url`` (the tier's ``backend``, its objects under ``_root``, every
    request made through ``_requests``)."""

    url: str
    backend: Any  # the tier's Backend (only the object-store tier itself imports the backends)
    _root: str
    _requests: Requests
    _expected: RemoteManifest | None = None  # read by the last listing that expected a step

    def read_manifest(self, step: int, *, once: bool = False) -> RemoteManifest:
        """The remote manifest of ``step``, validated (the remote tier's)."""
        raise NotImplementedError

    def _path(self, step: int, name: str | None = None) -> str:
        prefix = f"{self._root}/{step_dir_name(step)}"
        return f"{prefix}/{name}" if name else prefix

    def location(self, step: int, name: str | None = None) -> str:
        """The URL of a step's prefix or of one object in it, for messages."""
        prefix = f"{self.url}/{step_dir_name(step)}"
        return f"{prefix}/{name}" if name else prefix

    def check_bucket(self, *, once: bool = False) -> None:
        """Raise :class:`RemoteError` naming the bucket unless it exists and can be listed.

        One listing request, under the retry policy (``once``: tried once; a missing or
        unlistable bucket raises at once, saying which, its error not transient); a store
        without buckets (a file system, memory) has none to check.
        """
        bucket = self.backend.bucket
        if bucket is not None:
            self._requests.run(f"listing {self.url} to check its bucket {bucket}", self.backend.check_bucket, once=once)

    # -- listing -------------------------------------------------------------------------------

    def survey(self, *, once: bool = False, expect: int | None = None) -> tuple[list[int], list[int], list[int]]:
        """(committed, uncommitted, kept): steps whose remote manifest exists, prefixes holding
        objects but neither it nor the kept mark (half-uploaded steps), and prefixes with the
        mark but no manifest (files later steps reference), each oldest first.

        Each request (the listing, then one check of each step's manifest, and of the mark where
        there is none; :data:`CHECKS_AT_ONCE` checks at a time) is tried on its own under the
        retry policy: a listing of many steps goes through a store that fails a share of its
        requests as surely as one of a few steps.
        ``once``: the first request is tried once (a caller that can do without the bucket learns
        at once that it is failing); once it answered, the checks are retried as usual.
        ``expect``: a step the caller is about to read the manifest of (a restore's leader: the
        step its disk holds newest, or the one asked for). It is read beside the listing, tried
        once, and stands for that step's check; kept for :meth:`take_expected` if found (one
        round trip where a listing, a check and a read followed each other)."""
        if expect is not None:
            self._expected = None
        early = ThreadPoolExecutor(max_workers=1)
        try:
            guess = early.submit(self._read_if_there, expect) if expect is not None else None
            names = self._requests.run(f"listing {self.url}", lambda: self.backend.list_names(self._root), once=once)
            steps = sorted(step for step in map(parse_step_dir_name, names) if step is not None)

            def holds(step: int, name: str) -> bool:
                path = self._path(step, name)
                what = f"checking {self.location(step, name)}"
                return bool(self._requests.run(what, lambda: self.backend.exists(path)))

            def committed_here(step: int) -> bool:
                if guess is not None and step == expect:
                    try:
                        there, read = guess.result()
                    except RemoteError:
                        return holds(step, MANIFEST_NAME)  # its one try failed: check it under the policy
                    self._expected = read
                    return there
                return holds(step, MANIFEST_NAME)

            found = run_parallel(committed_here, steps, CHECKS_AT_ONCE)
        finally:
            # A listing that failed, or did not list the step, never waits for the guess: against a
            # bucket that hangs it ends within its own request's time, as without one.
            early.shutdown(wait=False, cancel_futures=True)
        committed = {step for step, held in zip(steps, found, strict=True) if held}
        rest = [step for step in steps if step not in committed]
        marked = run_parallel(lambda step: holds(step, KEPT_NAME), rest, CHECKS_AT_ONCE)
        kept = {step for step, held in zip(rest, marked, strict=True) if held}
        uncommitted = [step for step in steps if step not in committed and step not in kept]
        return sorted(committed), uncommitted, sorted(kept)

    def _read_if_there(self, step: int) -> tuple[bool, RemoteManifest | None]:
        """Whether ``step``'s remote manifest is there, by one try at reading it, and what was
        read (None: nothing, or a damaged manifest, there all the same: its reader meets the error)."""
        try:
            return True, self.read_manifest(step, once=True)
        except ManifestError:
            return True, None
        except RemoteError as exc:
            if is_missing(exc):
                return False, None
            raise

    def take_expected(self, step: int | None) -> RemoteManifest | None:
        """The remote manifest of ``step`` if the last listing expecting it read it (as current as
        that listing); handed over once, then let go (a manifest grows with the ranks), whatever
        ``step`` is (None: only let go). Else None."""
        expected, self._expected = self._expected, None
        return expected if expected is not None and expected.manifest.step == step else None

    def list_steps(self, *, once: bool = False, expect: int | None = None) -> tuple[list[int], list[int]]:
        """(committed, uncommitted) of :meth:`survey`."""
        committed, uncommitted, _kept = self.survey(once=once, expect=expect)
        return committed, uncommitted

    def steps(self) -> list[int]:
        """Steps whose remote manifest exists, oldest first."""
        return self.list_steps()[0]

    def uncommitted_steps(self) -> list[int]:
        """Step prefixes holding objects but no remote manifest nor kept mark (half-uploaded steps)."""
        return self.list_steps()[1]

    def kept_steps(self) -> list[int]:
        """Step prefixes holding the kept mark but no remote manifest: files later steps reference."""
        return self.survey()[2]
