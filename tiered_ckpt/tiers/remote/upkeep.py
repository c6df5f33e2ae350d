"""The remote tier's words for what a bucket holds beside its steps: owner records and open uploads.

A run holds its URL by an owner record (``owners/<run id>.json``, see
:mod:`~tiered_ckpt.tiers.remote.leases`), and an upload that failed or was killed may leave a
multipart upload open under it. :class:`BucketUpkeep` is the part of
:class:`~tiered_ckpt.tiers.remote.tier.RemoteTier` that reads, writes and removes those, each
request under the tier's retry policy, every key named exactly.
"""

from __future__ import annotations

import logging
import time
from functools import partial
from typing import Any

from tiered_ckpt.format.layout import OWNERS_DIR, owner_name, parse_owner_name, parse_step_dir_name
from tiered_ckpt.io.parallel import run_parallel
from tiered_ckpt.tiers.remote.requests import Requests

__all__ = ["BucketUpkeep", "MAX_OWNER_BYTES"]

logger = logging.getLogger("tiered_ckpt")

MAX_OWNER_BYTES = 64 << 10  # an owner record is a few hundred bytes; a bigger object is not one
_OWNERS_AT_ONCE = 16  # owner records read at once: each read waits for the store's first byte


class BucketUpkeep:
    """Owner records and open multipart uploads under ``url`` (the tier's ``backend``, its objects
    under ``_root``, every request made through ``_requests``)."""

    url: str
    backend: Any  # the tier's Backend (only the object-store tier itself imports the backends)
    _root: str
    _requests: Requests

    # -- unfinished multipart uploads ----------------------------------------------------

    def abort_orphans(self, older_than_seconds: float = 0.0, *, now: float | None = None) -> list[str]:
        """Abort the multipart uploads left open under this tier's URL by an upload that failed or
        was killed, started at least ``older_than_seconds`` before ``now`` (a Unix time; default:
        the clock's); return their URLs.

        The caller makes sure no live run is uploading under the URL (see
        :mod:`~tiered_ckpt.tiers.remote.leases`): an open upload does not say which run started it.
        Only uploads of this library's objects (``step-*/...`` under the URL) are touched;
        a store that lists no unfinished uploads (see its backend) has none to abort.
        """
        uploads = self._requests.run(
            f"listing unfinished multipart uploads under {self.url}", self.backend.open_uploads
        )
        now = time.time() if now is None else now
        aborted = []
        for upload in uploads:
            relative = upload.path[len(self._root) :].lstrip("/")
            if parse_step_dir_name(relative.split("/", 1)[0]) is None or "/" not in relative:
                continue  # not an object of ours
            if upload.started is not None and now - upload.started.timestamp() < older_than_seconds:
                continue  # may belong to an upload still running
            location = f"{self.url}/{relative}"
            what = f"aborting the unfinished multipart upload of {location}"
            self._requests.run(what, partial(self.backend.abort_upload, upload))
            logger.warning("aborted an unfinished multipart upload of %s (started %s)", location, upload.started)
            aborted.append(location)
        return aborted

    # -- owner records (see tiered_ckpt.tiers.remote.leases) -----------------------------------------

    def owner_location(self, run_id: str) -> str:
        """The URL of run ``run_id``'s owner record, for messages."""
        return f"{self.url}/{OWNERS_DIR}/{owner_name(run_id)}"

    def write_owner(self, run_id: str, document: bytes) -> None:
        """Write (or overwrite) run ``run_id``'s owner record."""
        path = f"{self._root}/{OWNERS_DIR}/{owner_name(run_id)}"
        self._requests.run(f"writing {self.owner_location(run_id)}", lambda: self.backend.put_bytes(path, document))

    def read_owners(self, besides: str | None = None) -> dict[str, bytes]:
        """Every owner record under the URL but run ``besides``'s, by run id (an exact listing of
        ``owners/``, then up to 16 records read at once; a record deleted while listed is left
        out; at most 64 KiB + 1 byte of each is read). A read that fails raises (as
        :class:`RemoteError`, under the retry policy) once every read started has ended."""
        directory = f"{self._root}/{OWNERS_DIR}"

        def read_one(item: tuple[str, str]) -> tuple[str, bytes | None]:
            run_id, path = item
            try:
                return run_id, self.backend.read(path, 0, MAX_OWNER_BYTES + 1)
            except FileNotFoundError:
                return run_id, None  # released while we listed

        def read() -> dict[str, bytes]:
            named = ((parse_owner_name(path.rsplit("/", 1)[-1]), path) for path in self.backend.find(directory))
            wanted = [(run_id, path) for run_id, path in named if run_id is not None and run_id != besides]
            found = run_parallel(read_one, wanted, _OWNERS_AT_ONCE)
            return {run_id: data for run_id, data in found if data is not None}

        return self._requests.run(f"reading the owner records under {self.url}/{OWNERS_DIR}", read)

    def delete_owner(self, run_id: str) -> None:
        """Delete run ``run_id``'s owner record (none there is no error)."""
        path = f"{self._root}/{OWNERS_DIR}/{owner_name(run_id)}"
        self._requests.run(f"deleting {self.owner_location(run_id)}", lambda: self.backend.delete([path]))
