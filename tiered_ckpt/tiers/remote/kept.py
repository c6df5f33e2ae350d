"""The remote tier's retention by reachability: an earlier step's object stays while a committed step references it.

An incremental save's shard references files of earlier steps
(:attr:`~tiered_ckpt.format.manifest.ShardRecord.references`). In the bucket each such file is
an object under its own step's prefix, put there when that step was uploaded or, if it never
was, with the first step referencing it; objects never move (a committed remote manifest
records where they are, and is never rewritten). So:

- a step's prefix that holds objects committed steps reference, but no remote manifest (the
  step was deleted, or never committed there), holds the mark ``kept-for-later-steps.json``,
  written before its manifest is deleted, or before the commit of the first step referencing
  it: such a prefix is never taken for a half-uploaded step, which a start-up removes;
- deleting a step removes its manifest, then each of its objects no committed step references,
  by its exact key (every object of it where a committed manifest cannot be read);
- :meth:`KeptObjects.collect_unreferenced`, after each retention pass, removes the objects of
  marked prefixes no committed step references any more, and the mark with the last one;
- a landing never puts another file over an object a committed step holds or keeps
  (:meth:`KeptObjects.refuse_replacing_kept`).

A file landed for a step being uploaded is referenced by no committed step until its commit;
it is under the prefix of a step newer than every committed one (an upload's references name
files the step before it holds or references, and that step, if committed, keeps them), which
a pass during uploads leaves alone: only a start-up, with no upload running, collects those.
"""

from __future__ import annotations

import logging

from tiered_ckpt.errors import CheckpointError, ManifestError, RemoteError
from tiered_ckpt.format.layout import KEPT_NAME, MANIFEST_NAME
from tiered_ckpt.format.manifest import ShardRecord
from tiered_ckpt.format.remote_manifest import StoredObject, referenced_key
from tiered_ckpt.tiers.remote.compression import object_name
from tiered_ckpt.tiers.remote.listing import BucketListing
from tiered_ckpt.tiers.remote.requests import is_missing

__all__ = ["KeptObjects"]

logger = logging.getLogger("tiered_ckpt")

_MARK = b"{}\n"


class KeptObjects(BucketListing):
    """Referenced objects under ``url`` (the tier's ``backend``, its objects under ``_root``,
    every request made through ``_requests``): the part of the remote tier that reads its
    listing (:meth:`survey`) and its remote manifests (:meth:`read_manifest`) to keep them."""

    _referenced: dict[str, tuple[StoredObject, str]]  # the remote tier's: what manifests read here say

    def mark_kept(self, step: int, deadline: float | None = None) -> None:
        """Put the kept mark in ``step``'s prefix (before a commit referencing its files, or before
        its manifest is deleted while they are referenced); ``deadline`` as for the commit's requests."""
        path, what = self._path(step, KEPT_NAME), f"writing {self.location(step, KEPT_NAME)}"
        self._requests.run(what, lambda: self.backend.put_bytes(path, _MARK), deadline)

    def referenced_objects(self, committed: list[int], *, after: int = -1) -> dict[int, set[str]] | None:
        """By step, the names (under the step's prefix) of the objects that the committed steps
        newer than ``after`` reference (only a newer step references a step's files); None if
        one of their remote manifests cannot be read: what they reference is then unknown."""
        referenced: dict[int, set[str]] = {}
        for step in committed:
            if step <= after:
                continue
            try:
                remote = self.read_manifest(step)
            except CheckpointError as exc:
                if is_missing(exc):
                    continue  # deleted since the listing: it references nothing any more
                return None
            for ref, stored in remote.referenced_files():
                referenced.setdefault(ref.step, set()).add(object_name(stored.location, stored.compression))
        return referenced

    def keep_only(self, step: int, kept: set[str]) -> bool:
        """Delete, by exact key, every object of ``step``'s prefix (a step with no remote manifest)
        but ``kept`` and the mark, then the mark if none of ``kept`` is there; True if the prefix
        is empty now."""
        prefix = self._path(step)

        def remove() -> bool:
            names = {path[len(prefix) + 1 :]: path for path in self.backend.find(prefix)}
            if MANIFEST_NAME in names:
                return False  # committed again meanwhile: its own retention decides
            gone = [path for name, path in names.items() if name not in kept and name != KEPT_NAME]
            if gone:
                self.backend.delete(gone)
            if kept.isdisjoint(names):
                self.backend.delete_prefix(prefix)  # the mark, last
                return True
            return False

        return bool(self._requests.run(f"removing unreferenced objects of {self.location(step)}", remove))

    def collect_unreferenced(self, *, all_steps: bool = False) -> list[int]:
        """Remove the objects of marked prefixes that no committed step references any more (each
        by its exact key), and the mark with the last; return the steps whose prefix is empty now.

        Only prefixes of steps older than the newest committed one (a newer one may be receiving
        files a step being uploaded references), unless ``all_steps`` (no upload is running: a
        start-up). Nothing is removed if a committed step's remote manifest cannot be read."""
        committed, _uncommitted, kept = self.survey()
        newest = max(committed, default=-1)
        candidates = [step for step in kept if all_steps or step < newest]
        if not candidates:
            return []
        referenced = self.referenced_objects(committed)
        if referenced is None:
            return []
        return [step for step in candidates if self.keep_only(step, referenced.get(step, set()))]

    def find_referencing(self, step: int, path: str) -> None:
        """Read the remote manifests of the committed steps after ``step``, newest first, until one
        references its file ``path`` (a file kept for later steps, read before any of them)."""
        for later in reversed([each for each in self.steps() if each > step]):
            try:
                self.read_manifest(later)
            except (ManifestError, RemoteError) as exc:  # an older step may say it: read on
                if not is_missing(exc):
                    logger.warning("%s: looking for where step %d's %s is kept: %s", self.url, step, path, exc)
            if referenced_key(step, path) in self._referenced:
                return

    def refuse_replacing_kept(self, step: int, name: str, record: ShardRecord) -> None:
        """Raise :class:`RemoteError`, not transient, if a committed step holds the object ``name`` of
        ``step`` as another file than ``record``: ``step`` itself (committed as another checkpoint),
        or a later step referencing it (the bucket keeps it for that step). Putting it would change
        a committed step: a run that went back and saves that step number again."""
        for committed in self.steps():
            if committed < step:
                continue
            remote = self.read_manifest(committed)
            if committed == step:
                other = [each for each in remote.manifest.shards if each.path == record.path]
                if other and other[0].sha256 != record.sha256:
                    raise RemoteError(
                        f"{self.location(step, name)}: a different checkpoint of step {step} is already committed",
                        transient=False,
                    )
                continue
            for ref, stored in remote.referenced_files():
                same_object = ref.step == step and object_name(stored.location, stored.compression) == name
                if same_object and ref.file.sha256 != record.sha256:
                    raise RemoteError(
                        f"{self.location(step, name)}: kept for step {committed}, which references it as another "
                        f"file than this step {step} has: a step number whose files the bucket keeps is not saved "
                        "again (restore a later step, or save under a new number)",
                        transient=False,
                    )
