"""Lightning's checkpoints through a :class:`~tiered_ckpt.CheckpointManager`: both tiers, verified, no pickle.

``Trainer(plugins=[TieredCheckpointIO(manager)])`` (or ``Fabric(plugins=[...])``) makes every
checkpoint Lightning saves a step of ``manager``; ``trainer.fit(model, ckpt_path="last")`` or
``ckpt_path=io.ckpt_path(step)`` restores one, from local disk or the bucket. Needs the
``lightning`` package (``pip install tiered-ckpt[lightning]``); ``import tiered_ckpt`` never
imports it.

What is stored: the checkpoint dict Lightning hands over, as it is: the step's state. Its
tensors stay tensors (the model's ``state_dict``, the optimizers' states with their ``int``
keys), and ints, floats (``inf`` and ``nan`` exactly), bools, strings, None, lists, tuples and
dicts keep their types. Nothing is converted, so nothing is lost quietly: a value a state
cannot hold without pickle (a ``pathlib.Path`` or ``argparse.Namespace`` among the
``hyper_parameters``, OmegaConf's ``hparams_type`` class, ...) fails the save with
:class:`InvalidStateError` naming its path, before anything is written. A dict subclass
(Lightning's ``AttributeDict``) is stored as a dict, as :meth:`CheckpointManager.save` stores it.

Steps and paths: the step is the checkpoint's ``global_step`` (``step_key``; Fabric's state
names its own). At the ``path`` Lightning gives, the plugin writes a *pointer*: a small JSON
file naming the step and the manager, written durably once the step is committed on local
disk. Lightning's own bookkeeping reads these pointers as it reads checkpoint files:
``ModelCheckpoint``'s top-k and ``last.ckpt``, its version counters, ``ckpt_path="last"`` (the
newest ``last*.ckpt`` in the callback's directory) and ``remove_checkpoint`` (which removes the
pointer only: the manager's retention decides when a step is deleted). A step Lightning saves
under two names (the top-k file and ``last.ckpt`` of one step) is saved once, and the other
names point at it: a pointer is written only for the contents the step holds. Each save and
load takes the xxh3-128 of the checkpoint (its structure, every value and every tensor's bytes:
one pass over host memory, a copy to host for a tensor on another device), and a save of a step
already saved or loaded here with other contents (weights changed without an optimizer step: an
adapter merged, weights averaged or quantized after resuming a finished run) raises
:class:`CheckpointExistsError` and writes nothing: a step is saved once, so such weights go to
a new step or elsewhere. Left out of the comparison is Lightning's bookkeeping that moves on
after a step's training without an optimizer step (``epoch``, ``loops``, ``callbacks``,
``lr_schedulers``: the end of an epoch, which files ``ModelCheckpoint`` wrote): ``fit`` then
``trainer.save_checkpoint(path)`` names the step the callback saved, which keeps the first
save's bookkeeping (a WARNING names what moved on: the later values are not stored). :meth:`load_checkpoint` takes a
pointer or a step's directory, ``<local.dir>/step-000000000100`` (:meth:`ckpt_path`), which
need not exist: the manager restores the step from whichever tier holds it.

Metrics: a save that a ``ModelCheckpoint`` ranks records its score under the name of the
metric the callback monitors (``save(..., metrics={monitor: score})``), and with the
:class:`RecordMetrics` callback every save records the logged metrics it names, so that a
tier's ``keep_best`` retention (``best_metric`` the same name, ``best_mode`` the callback's
``mode``) keeps the best steps, beyond the steps the live pointers hold.

Blocking: :meth:`save_checkpoint` returns once the step is committed on local disk and its
pointer is written; the upload goes on in the manager's background. It does not return
earlier (as ``manager.save`` could, once the state is staged): Lightning takes a returned save
for a checkpoint in place and removes older ones right after, and ``AsyncCheckpointIO`` never
calls the wrapped plugin's ``teardown``, so a save still running then would never get its
pointer. For saves off the training loop, wrap the plugin in Lightning's own
``AsyncCheckpointIO``: it copies the tensors on the loop's thread and calls this plugin from a
thread of its own, whose pending saves its ``teardown`` waits for.

Several processes (``TieredDDPStrategy``, ``TieredModelParallelStrategy``,
``TieredFSDPStrategy``: see :mod:`tiered_ckpt.lightning_strategies`): each rank's plugin holds
that rank's manager, made by the factory given (``TieredCheckpointIO(make)``, called on each
rank once its process group is up), and every rank saves each checkpoint together
(``save(..., replicated=True)``): under DDP every array is written once, by one of the ranks,
and put back on every rank at load; under FSDP (FSDP2 or FSDP1) each rank writes its own
chunks, and a load fills the model's and optimizers' DTensors in place; on another number of
ranks too (from the bucket). Rank 0 writes the
pointers and decides which step a path names; the other ranks hold the steps rank 0's live
pointers name, as rank 0 tells them at each save and load.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import weakref
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch
import torch.distributed
from lightning.fabric.plugins import CheckpointIO
from lightning_utilities.core.apply_func import apply_to_collection

from tiered_ckpt.dist.coordination import Attempt, TorchDistributedCoordinator, gather, leader_decides
from tiered_ckpt.engine.restore_result import RestoreResult
from tiered_ckpt.errors import (
    CheckpointError,
    CheckpointExistsError,
    CheckpointNotFoundError,
    InvalidStateError,
    UsageError,
    restated,
)
from tiered_ckpt.format.layout import parse_step_dir_name, step_dir_name
from tiered_ckpt.io.durable import write_bytes
from tiered_ckpt.lightning_export import export_lightning
from tiered_ckpt.lightning_load import POINTER_FORMAT, POINTER_VERSION, device_of, load_from_checkpoint, parse_pointer
from tiered_ckpt.lightning_metrics import METRICS_KEY, RecordMetrics, monitored
from tiered_ckpt.lightning_saved import SavedStep
from tiered_ckpt.lightning_strategies import TieredDDPStrategy, TieredFSDPStrategy, TieredModelParallelStrategy
from tiered_ckpt.manager import CheckpointManager

__all__ = [
    "TieredCheckpointIO",
    "TieredDDPStrategy",
    "TieredFSDPStrategy",
    "TieredModelParallelStrategy",
    "RecordMetrics",
    "POINTER_FORMAT",
    "export_lightning",
    "load_from_checkpoint",
]

logger = logging.getLogger("tiered_ckpt")


class TieredCheckpointIO(CheckpointIO):
    """A Lightning ``CheckpointIO`` that saves each checkpoint as a step of ``manager`` (see the module doc).

    ``manager`` holds one rank in this process: the one rank of a job of one process, or, under
    :class:`TieredDDPStrategy`, :class:`TieredModelParallelStrategy` or
    :class:`TieredFSDPStrategy`, this process's rank of the job (a ``TorchDistributedCoordinator``).
    It is a :class:`CheckpointManager`, or a function making one, called on first use (under DDP:
    on each rank, once Lightning has set up its process group). It stays the caller's: the
    plugin never closes it (close it after ``fit``, :attr:`manager`, to wait for the uploads).
    ``step_key`` is the checkpoint's key holding the step: ``"global_step"`` for the
    ``Trainer``; with ``Fabric``, the key of the state passed to ``fabric.save`` that holds it.
    After a load, :attr:`last_restore` is the manager's :class:`RestoreResult` of it without
    its arrays (its step, the tier each shard came from, the bytes read).
    """

    saves_on_every_rank = False
    """Set by the strategies of :mod:`tiered_ckpt.lightning_strategies`, which call
    :meth:`save_checkpoint` on every rank."""

    def __init__(
        self, manager: CheckpointManager | Callable[[], CheckpointManager], *, step_key: str = "global_step"
    ) -> None:
        if not isinstance(manager, CheckpointManager) and not callable(manager):
            raise UsageError(
                f"{type(self).__name__} takes a CheckpointManager or a function making one: {manager!r:.60}"
            )
        super().__init__()
        self._manager: CheckpointManager | None = None
        self._make = manager
        self._making = threading.Lock()
        self._job: TorchDistributedCoordinator | None = None  # this plugin's channel to the other ranks' plugins
        self.step_key = step_key
        self.last_restore: RestoreResult | None = None
        self._lock = threading.Lock()  # AsyncCheckpointIO saves from a thread of its own
        self._newest: SavedStep | None = None  # the newest step saved or loaded here
        # Pointers removed before their save wrote them: AsyncCheckpointIO queues saves, while the
        # loop removes a checkpoint that fell out of the top k at once. Guarded by _pointers, which
        # a save holds only around writing its pointer (not its whole save).
        self._unwanted: set[Path] = set()
        self._pointers = threading.Lock()
        self._named: dict[Path, int] = {}  # the live pointers, by path: their steps are held from retention
        self._holder = object()  # this plugin's holds on the manager's store (another plugin may share it)
        if isinstance(manager, CheckpointManager):
            _ = self.manager

    @property
    def manager(self) -> CheckpointManager:
        """The manager given, or made by the function given (on the first call)."""
        with self._making:
            if self._manager is None:
                made = self._make if isinstance(self._make, CheckpointManager) else self._made()
                if not isinstance(made, CheckpointManager) or len(made.ranks) != 1:
                    raise UsageError(
                        f"{type(self).__name__} needs a CheckpointManager of one rank in this process: {made!r:.200}"
                        + (f" holding ranks {list(made.ranks)}" if isinstance(made, CheckpointManager) else "")
                    )
                # A plugin dropped (its Trainer done) releases its holds: its pointers are a later plugin's to hold.
                weakref.finalize(self, made.store.hold, (), holder=self._holder)
                self._manager = made
            return self._manager

    def _made(self) -> CheckpointManager:
        assert not isinstance(self._make, CheckpointManager)
        try:
            return self._make()
        except UsageError as exc:
            if torch.distributed.is_initialized():
                raise
            raise restated(
                exc,
                f"{exc} (the plugin makes its manager on first use, which under DDP is once Lightning has set up "
                'the process group: resume with ckpt_path="last" or a pointer\'s path, not io.ckpt_path())',
            ) from exc

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self._manager or self._make!r}, step_key={self.step_key!r})"

    def _ranks(self, what: str) -> TorchDistributedCoordinator | None:
        """The channel to the other ranks' plugins (None: a job of one process); :class:`UsageError`
        if the manager does not hold this process's rank of the job, or (a save) if Lightning's
        strategy does not save on every rank."""
        manager = self.manager
        size = torch.distributed.get_world_size() if torch.distributed.is_initialized() else 1
        if manager.world_size != size:
            raise UsageError(
                f"TieredCheckpointIO cannot {what} in a job of {size} processes with a manager of {manager.world_size} "
                "ranks: give each rank a manager of its own (a function making a CheckpointManager of the rank's "
                "local.dir with a TorchDistributedCoordinator) and Trainer(strategy=TieredDDPStrategy())"
            )
        if size == 1:
            return None
        if what == "save" and not self.saves_on_every_rank:
            raise UsageError(
                "TieredCheckpointIO saves a job of several processes on every rank together, and Lightning's "
                "strategies save on rank 0 only: use Trainer(strategy=TieredDDPStrategy())"
            )
        if self._job is None:
            self._job = TorchDistributedCoordinator()
        return self._job

    def open(self) -> None:
        """Make the manager, and the channel to the other ranks' plugins, now rather than at the
        first save or load: the strategies of :mod:`tiered_ckpt.lightning_strategies` call it on
        every rank once the process group is up, so that no process group is made on the thread
        of ``AsyncCheckpointIO``'s saves while the training loop makes its own. Raises
        :class:`UsageError` as a save would for a manager that does not fit the job."""
        self._ranks("open")

    def __copy__(self) -> TieredCheckpointIO:
        """This plugin itself: a copy of what holds it (``copy.deepcopy`` of a Trainer or of a loop)
        shares it and its manager, as it would share an open file; nothing is pickled."""
        return self

    def __deepcopy__(self, memo: dict[int, Any]) -> TieredCheckpointIO:
        """This plugin itself (see :meth:`__copy__`)."""
        return self

    def __getstate__(self) -> dict[str, Any]:
        """Refused: the plugin holds a running manager (its threads, the lock on its directory),
        which only the process that opened it can use (``torch.save(trainer)`` pickles it)."""
        of = f" of {self._manager.root}" if self._manager is not None else ""
        raise UsageError(
            f"{type(self).__name__} cannot be pickled: it holds a running CheckpointManager{of} (its threads and the "
            "lock on its directory belong to this process); "
            "save the model or its state_dict instead, and give a new process a plugin of its own manager"
        )

    # -- saving ---------------------------------------------------------------------------

    def save_checkpoint(
        self, checkpoint: dict[str, Any], path: str | os.PathLike[str], storage_options: Any | None = None
    ) -> None:
        """Save ``checkpoint`` as the step its ``step_key`` holds and write the pointer at ``path``.

        Returns once the step is committed on local disk and the pointer is durable (the
        upload goes on in the background). A step already saved (or loaded) here with the
        same contents (the same xxh3-128 of its structure and bytes) is not saved again: the
        pointer names it. Raises :class:`InvalidStateError` for a value that cannot be stored
        (naming its path) or a step that is not an ``int``, :class:`CheckpointExistsError`
        for a step not newer than the manager's newest (a run resumed from an older step, or
        started afresh over saved steps) or saved or loaded here with other contents (other
        top-level keys, or weights changed without an optimizer step),
        :class:`UsageError` for ``storage_options`` or a step the manager's cadence skips,
        and the manager's background errors; nothing is written then.
        """
        if storage_options is not None:
            raise UsageError(
                f"{type(self).__name__} takes no storage_options (got {storage_options!r:.80}): "
                "the manager's options say where steps go"
            )
        job = self._ranks("save")
        with self._lock:
            checked = Attempt.run(lambda: self._checked(checkpoint, path))
            if job is not None:  # a refusal on one rank is every rank's, before any rank enters the save
                self._agree(job, checked)
            target, step, checkpoint, saved, metrics = checked.value
            if self._newest is None or self._newest.step != step:  # else saved already with these contents
                self._save(step, checkpoint, target, metrics, replicated=job is not None)
                self._newest = saved
            if job is None:
                self._write_pointer(target, step)
            else:  # rank 0 writes it; the others hold what rank 0's pointers name
                self._adopt(job, lambda: self._write_pointer(target, step))

    def _checked(
        self, checkpoint: dict[str, Any], path: str | os.PathLike[str]
    ) -> tuple[Path, int, dict[str, Any], SavedStep, dict[str, Any]]:
        """A save's checks: its pointer's path, its step, what it stores, its fingerprint and its
        metrics; raises as :meth:`save_checkpoint` says (a step saved here with other contents)."""
        target = _local_path(path)
        step = self._step_of(checkpoint, target)
        recorded = checkpoint.get(METRICS_KEY)
        metrics = {**(recorded if isinstance(recorded, dict) else {}), **monitored(checkpoint, path)}
        checkpoint = {key: value for key, value in checkpoint.items() if key != METRICS_KEY}
        saved = SavedStep.of(step, checkpoint, str(target))
        if self._newest is not None and self._newest.step == step:
            self._newest.refuse_other(saved, target)
        return target, step, checkpoint, saved, metrics

    def _agree(self, job: TorchDistributedCoordinator, checked: Attempt[Any]) -> None:
        """Raise ``checked``'s error on every rank if it failed on any; else every rank holds the
        steps rank 0's live pointers name (a removal since the last save included), so that the
        save's retention deletes no rank's shard of them, nor keeps one rank 0 released."""

        def mine() -> _Named:
            checked.done()
            return self._named_now()

        told = gather(job, "Lightning: the save's checks", _Named, mine)[0]
        if not job.is_leader:
            self._hold_named(told)

    def _named_now(self) -> _Named:
        with self._pointers:
            return _Named(tuple(sorted((str(path), step) for path, step in self._named.items())))

    def _hold_named(self, told: _Named) -> None:
        with self._pointers:
            self._named = {Path(path): step for path, step in told.named}
            self.manager.store.hold(set(self._named.values()), holder=self._holder)

    def _write_pointer(self, target: Path, step: int) -> None:
        target.parent.mkdir(parents=True, exist_ok=True)
        with self._pointers:
            if target in self._unwanted:  # removed while this save was queued: the step stays, unnamed
                self._unwanted.discard(target)
                return
            write_bytes(target, self._pointer(step))
            self._name(target, step)

    def _adopt(self, job: TorchDistributedCoordinator, leader: Callable[[], None]) -> None:
        """Run ``leader`` on rank 0; then every rank holds the steps rank 0's live pointers name
        (a collective: ``leader``'s error is raised on every rank)."""

        def named() -> _Named:
            leader()
            return self._named_now()

        told = leader_decides(job, "Lightning: the steps the pointers name", _Named, named)
        if not job.is_leader:
            self._hold_named(told)

    def _step_of(self, checkpoint: Any, target: Path) -> int:
        if not isinstance(checkpoint, dict):
            raise InvalidStateError(f"{target}: the checkpoint is a {type(checkpoint).__name__}, not a dict")
        step = checkpoint.get(self.step_key)
        if type(step) is not int or step < 0:
            raise InvalidStateError(
                f"{target}: checkpoint[{self.step_key!r}] must be the step, an int >= 0; got {step!r:.80} "
                f"({type(step).__name__})" + ("" if self.step_key in checkpoint else ": the key is missing")
            )
        return step

    def _save(
        self, step: int, checkpoint: dict[str, Any], target: Path, metrics: dict[str, Any], *, replicated: bool
    ) -> None:
        manager = self.manager
        if not manager.should_save(step):
            raise UsageError(
                f"{target}: the manager's cadence (local.every={manager.options.local.every}) skips step {step}: "
                "save checkpoints only at the steps it takes (ModelCheckpoint(every_n_train_steps=...))"
            )
        try:
            handle = manager.save(step, checkpoint, blocking=True, metrics=metrics, replicated=replicated)
        except CheckpointExistsError as exc:
            raise restated(
                exc,
                f"{target}: {exc}: this run is behind the manager's newest step (it resumed from an older step, or "
                "started afresh over saved steps); resume from the newest (ckpt_path=io.ckpt_path()), or save this "
                "run under another local.dir and remote.url",
            ) from exc
        except CheckpointError as exc:
            raise restated(exc, f"{target}: {exc}") from exc
        if handle.committed.result() is None:  # no tier took it after all (a partner's memory, one node)
            raise UsageError(f"{target}: no tier of the manager kept step {step}")

    def _pointer(self, step: int) -> bytes:
        remote = self.manager.options.remote
        document = {
            "format": POINTER_FORMAT,
            "version": POINTER_VERSION,
            "step": step,
            "local": str(self.manager.root.resolve()),
            "remote": remote.url if remote is not None else None,
        }
        return json.dumps(document, indent=1).encode()

    def remove_checkpoint(self, path: str | os.PathLike[str]) -> None:
        """Remove the pointer at ``path``. The step stays: the manager's retention deletes
        steps. A pointer not written yet (its save queued by ``AsyncCheckpointIO``) is not
        written when its save comes: ModelCheckpoint removes only what it saved, so a removal
        of a pointer that is not there is one of a save still to come. Raises
        :class:`UsageError`, removing nothing, if ``path`` is something else (a file of another
        kind, a directory such as a step's)."""
        target = _local_path(path)
        # Not under the saves' lock: under AsyncCheckpointIO the loop removes while a save runs.
        with self._pointers:
            if not os.path.lexists(target):
                self._unwanted.add(target)
                return
            if not target.exists():
                target.unlink()  # a link to a pointer removed already
                return
            parse_pointer(target)  # refuses anything that is not a pointer
            target.unlink()
            self._name(target, None)

    def _name(self, target: Path, step: int | None) -> None:
        """The pointer at ``target`` names ``step`` (None: no step any more); the steps the live
        pointers name are held from every tier's retention (the caller holds ``_pointers``)."""
        if step is None:
            self._named.pop(target, None)
        else:
            self._named[target] = step
        self.manager.store.hold(set(self._named.values()), holder=self._holder)

    def teardown(self) -> None:
        """Raise a background error of the manager not raised yet (a permanent upload failure)."""
        if self._manager is not None:
            self._manager.check_for_errors()

    # -- loading --------------------------------------------------------------------------

    def ckpt_path(self, step: int | None = None) -> str | None:
        """The ``ckpt_path`` that restores ``step`` (default: the newest step on disk or in the bucket),
        from whichever tier holds it; None if ``step`` is None and no tier holds a step, so that
        ``trainer.fit(model, ckpt_path=io.ckpt_path())`` resumes or starts afresh. It is the step's
        directory under ``local.dir``, whether or not it exists on this disk."""
        if step is None:
            step = self.manager.latest_step()
            if step is None:
                return None
        if type(step) is not int or step < 0:
            raise UsageError(f"step must be an int >= 0, got {step!r:.80}")
        return str(self.manager.root / step_dir_name(step))

    def load_checkpoint(
        self,
        path: str | os.PathLike[str],
        map_location: Any | None = None,
        weights_only: bool | None = None,
        *,
        into: dict[str, Any] | None = None,
    ) -> dict[str, Any]:
        """The checkpoint dict of the step ``path`` names, as it was saved, every shard verified.

        ``path`` is a pointer this plugin wrote, or a step's directory under the manager's
        ``local.dir`` or ``remote.url`` (:meth:`ckpt_path`); the step comes from local disk
        when it is there and intact, else from the bucket. Tensors come back on the CPU, or
        on ``map_location`` (a device or its name). Nothing is unpickled, so ``weights_only``
        has nothing to restrict: it is accepted and ignored. ``into`` (what
        :class:`TieredModelParallelStrategy` gives: the model's and the optimizers' states of
        DTensors, by their keys in the checkpoint) is filled in place, each chunk from the saved
        chunks that overlap it, and stands in the checkpoint returned for the values it holds. Raises
        :class:`CheckpointNotFoundError` (a ``FileNotFoundError``) for a path that does not
        exist and is no step's directory, :class:`UsageError` for a path that names no step of
        this manager (naming what it is), :class:`ManifestError`
        for a damaged pointer, and what :meth:`CheckpointManager.restore` raises.
        """
        job = self._ranks("load")
        device = device_of(map_location)
        if job is None:
            step = self._step_named(path)
        else:  # rank 0's pointers: the other ranks may not see its files
            step = leader_decides(job, "Lightning: the step to load", _Step, lambda: _Step(self._step_named(path))).step
        with self._lock:
            # On another number of ranks too; into: the model's and the optimizers' DTensors, filled in place.
            result = self.manager.restore(step, reshard=job is not None or into is not None, into=into)
            checkpoint = result.torch_state() if into is None else _merged(into, result.torch_state())
            self.last_restore = replace(result, states=[], flat=())
            self._newest = SavedStep.of(step, checkpoint, os.fspath(path))
        if job is None:
            self._name_recorded(checkpoint)
        else:
            self._adopt(job, lambda: self._name_recorded(checkpoint))
        logger.info("restored step %d for Lightning from %s", step, os.fspath(path))
        if device is not None:
            checkpoint = apply_to_collection(checkpoint, torch.Tensor, lambda tensor: tensor.to(device))
        return checkpoint

    def _name_recorded(self, checkpoint: dict[str, Any]) -> None:
        """After a load: the live pointers the checkpoint's ``ModelCheckpoint`` states record (the
        top k, the best, the last) are held again, as their saves held them."""
        recorded: list[Any] = []
        for state in (checkpoint.get("callbacks") or {}).values():
            if isinstance(state, dict):
                recorded += list(state.get("best_k_models") or {})
                recorded += [state.get(key) for key in ("best_model_path", "kth_best_model_path", "last_model_path")]
        with self._pointers:
            for text in recorded:
                if not isinstance(text, str) or not text or "://" in text:
                    continue
                target = Path(text).absolute()
                try:
                    self._named[target] = self._read_pointer(target)
                except (CheckpointError, OSError):  # removed since, or not one of this manager's
                    continue
            self.manager.store.hold(set(self._named.values()), holder=self._holder)

    def _step_named(self, path: str | os.PathLike[str]) -> int:
        text = os.fspath(path)
        if not isinstance(text, str):
            raise UsageError(f"{text!r:.200} is not a path of text")
        parent, _, name = text.rstrip("/").rpartition("/")
        step = parse_step_dir_name(name)
        if step is not None and self._holds_steps(parent):
            return step
        target = _local_path(path)
        if not target.exists():  # Lightning's CheckpointIO contract: a FileNotFoundError
            raise CheckpointNotFoundError(
                f"Checkpoint file not found: {os.fspath(path)} ({target} does not exist, and is not a step's "
                f"directory under "
                f"{self._places()}: give a pointer this plugin wrote, or a step's directory "
                f"({self.ckpt_path(100)} for step 100))"
            )
        return self._read_pointer(target)

    def _holds_steps(self, parent: str) -> bool:
        """True if ``parent`` is the directory holding the manager's steps: its ``local.dir`` or ``remote.url``."""
        remote = self.manager.options.remote
        if remote is not None and parent == remote.url.rstrip("/"):
            return True
        return "://" not in parent and bool(parent) and Path(parent).resolve() == self.manager.root.resolve()

    def _places(self) -> str:
        remote = self.manager.options.remote
        return " or ".join([str(self.manager.root)] + ([remote.url] if remote is not None else []))

    def _read_pointer(self, target: Path) -> int:
        """The step of the pointer at ``target``; :class:`UsageError` if it is no pointer or another manager's."""
        step, local, remote = parse_pointer(target)
        mine = self.manager.options.remote
        same_bucket = remote is not None and mine is not None and remote == mine.url
        if not same_bucket and Path(local) != self.manager.root.resolve():
            where = f"{local} and {remote}" if remote else local
            raise UsageError(f"{target} points at step {step} of {where}, not of this manager's {self._places()}")
        return step


@dataclass(frozen=True)
class _Step:
    """The step rank 0 found a path to name (what crosses the collective)."""

    step: int


@dataclass(frozen=True)
class _Named:
    """Rank 0's live pointers, as (path, step) (what crosses the collective)."""

    named: tuple[tuple[str, int], ...]


def _merged(into: Any, restored: Any) -> Any:
    """``restored`` with the tensors of ``into`` (at the same places, filled in place by the restore)
    standing for its own: a DTensor given comes back as itself, not as this rank's chunk."""
    if isinstance(restored, dict) and isinstance(into, dict):
        return {key: _merged(into[key], value) if key in into else value for key, value in restored.items()}
    if isinstance(restored, (list, tuple)) and isinstance(into, (list, tuple)) and len(into) == len(restored):
        return type(restored)(_merged(mine, value) for mine, value in zip(into, restored, strict=True))
    return into if isinstance(into, torch.Tensor) else restored


def _local_path(path: str | os.PathLike[str]) -> Path:
    text = os.fspath(path)
    if not isinstance(text, str) or "://" in text:
        raise UsageError(
            f"{text!r:.200}: the plugin writes its pointers on a local file system (the steps go to the manager's "
            "bucket): give ModelCheckpoint a local dirpath"
        )
    return Path(text).absolute()
