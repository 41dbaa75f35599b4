"""Training checkpoints: params, optimizer state and a JSON ``meta`` item, via Orbax.

One checkpoint is one step directory ``DIR/<step>/`` with three items:

* ``params``    a PyTree of arrays (an ``nnx.State`` is saved as its pure dict);
* ``opt_state`` a PyTree of arrays (an optax state; ``nnx.State``s inside it are saved
  as pure dicts too);
* ``meta``      a JSON dict, the :class:`~areal_jax.checkpoint.meta.CheckpointMeta` record:
  step, version, rng, the executor's accounting, the HF ``model_config``, the run config
  (and any other writer's JSON keys, kept in its ``extra``).

Saves are asynchronous: ``save`` returns once the arrays are copied off the devices
and the write continues in a background thread (so donating the buffers to the next
train step is safe). Orbax writes into a temporary directory and renames it (local
disk) or writes a commit marker (``gs://``) only when every item is durable, so a
process killed mid-save leaves the previous checkpoint as the latest readable one.

Restore onto devices by passing targets: PyTrees of ``jax.ShapeDtypeStruct`` (or
concrete arrays) whose ``sharding`` says where each array goes. Without a target,
arrays come back on the default device and containers as plain dicts/lists.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import logging
import os
import sys
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import jax
import numpy as np
import orbax.checkpoint as ocp
from flax import nnx

from areal_jax import storage
from areal_jax.checkpoint.meta import CheckpointMeta
from model_defs import CheckpointError, PyTree

if TYPE_CHECKING:  # annotations only: this room never loads the run config
    from areal_jax.config import CheckpointConfig

PARAMS, OPT_STATE, META = "params", "opt_state", "meta"


def _is_url(path: str) -> bool:
    return "://" in path


def require_gcs_support(path: str) -> None:
    """Checks the scheme (local or ``gs://``, see ``areal_jax.storage``) and, for ``gs://``,
    that gcsfs is installed (Orbax's directory operations use it through etils.epath);
    points tensorstore at ``STORAGE_EMULATOR_HOST`` when that is set."""
    try:
        storage.scheme_of(path)
    except storage.StorageError as e:
        raise CheckpointError(str(e)) from None
    storage.configure_environment()
    if path.startswith("gs://"):
        try:
            import gcsfs  # noqa: F401
        except ImportError:
            raise CheckpointError(f"{path}: gs:// paths need the gcsfs package "
                                  f"(pip install gcsfs)") from None


def _item_handlers() -> dict[str, ocp.CheckpointHandler]:
    return {
        PARAMS: ocp.StandardCheckpointHandler(),
        OPT_STATE: ocp.StandardCheckpointHandler(),
        META: ocp.JsonCheckpointHandler(),
    }


def _is_state(x: object) -> bool:
    return isinstance(x, nnx.State)


def _to_pure(tree: PyTree) -> PyTree:
    """Every ``nnx.State`` in ``tree`` (also inside an optax state) as its pure dict.

    Checkpoints then hold plain nested dicts, independent of NNX's Variable classes.
    """
    return jax.tree.map(lambda x: x.to_pure_dict() if _is_state(x) else x, tree,
                        is_leaf=_is_state)


def _abstract(tree: PyTree) -> PyTree:
    """Arrays / ShapeDtypeStructs -> ShapeDtypeStructs, keeping (or defaulting) shardings."""
    default = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])

    def leaf(x: object) -> jax.ShapeDtypeStruct:
        if isinstance(x, jax.ShapeDtypeStruct):
            return x if x.sharding is not None else jax.ShapeDtypeStruct(
                x.shape, x.dtype, sharding=default)
        if isinstance(x, jax.Array):
            return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding)
        if isinstance(x, np.ndarray | np.generic | int | float):
            arr = np.asarray(x)
            return jax.ShapeDtypeStruct(arr.shape, arr.dtype, sharding=default)
        raise CheckpointError(f"restore target leaf of type {type(x).__name__} is not an array")

    return jax.tree.map(leaf, tree)


def _key_str(path: tuple) -> str:
    return "/".join(str(getattr(k, "key", getattr(k, "idx", getattr(k, "name", k))))
                    for k in path) or "<root>"


def _flat_by_key(tree: PyTree) -> dict[str, Any]:
    return {_key_str(p): v for p, v in jax.tree_util.tree_flatten_with_path(tree)[0]}


def _check_target(saved_meta_tree: PyTree, target_abstract: PyTree, item: str,
                  where: str) -> None:
    """Names the first mismatching keys/shapes instead of letting Orbax fail deep inside."""
    saved = _flat_by_key(saved_meta_tree)
    wanted = _flat_by_key(target_abstract)
    missing = sorted(set(wanted) - set(saved))
    extra = sorted(set(saved) - set(wanted))
    if missing or extra:
        raise CheckpointError(
            f"{where}: {item} in the checkpoint does not match the restore target; "
            f"keys only in the target: {missing[:5]}{' ...' if len(missing) > 5 else ''}; "
            f"keys only in the checkpoint: {extra[:5]}{' ...' if len(extra) > 5 else ''}"
        )
    for key, want in wanted.items():
        have_shape = tuple(saved[key].shape)
        if have_shape != tuple(want.shape):
            raise CheckpointError(
                f"{where}: {item}/{key} has shape {have_shape} in the checkpoint but the "
                f"restore target expects {tuple(want.shape)}"
            )


def _default_target(saved_meta_tree: PyTree) -> PyTree:
    device = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
    return jax.tree.map(
        lambda m: jax.ShapeDtypeStruct(tuple(m.shape), m.dtype, sharding=device), saved_meta_tree
    )


def rng_to_json(key: jax.Array) -> list[int]:
    """A JAX PRNG key (typed or raw uint32) as a list of ints for ``CheckpointMeta.rng``."""
    if jax.dtypes.issubdtype(key.dtype, jax.dtypes.prng_key):
        key = jax.random.key_data(key)
    return [int(v) for v in np.asarray(key).reshape(-1)]


def rng_from_json(data: list[int], *, typed: bool = True) -> jax.Array:
    """Inverse of ``rng_to_json`` for the default (threefry) implementation."""
    raw = np.asarray(data, dtype=np.uint32)
    if raw.shape != (2,):
        raise CheckpointError(f"meta rng must be 2 uint32 words (threefry), got {list(data)!r}")
    words = jax.numpy.asarray(raw)
    return jax.random.wrap_key_data(words) if typed else words


class CheckpointWriteError(CheckpointError):
    """A checkpoint could not be written (a full disk, a lost bucket): a fault of the
    environment, reported in one line; the newest complete checkpoint is kept."""


class _DropReraisedSaveErrors(logging.Filter):
    """Drops the ERROR records with tracebacks that Orbax's save threads log for a failed
    write (five or more per failure): the same error is raised again in the caller by the
    next ``save`` or ``wait``, where :class:`TrainCheckpointer` makes it one line."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not (record.levelno >= logging.ERROR and record.exc_info is not None
                    and f"{os.sep}orbax{os.sep}" in record.pathname)


_SAVE_ERRORS_FILTER = _DropReraisedSaveErrors()


class _DropReadOnlyNotice(logging.Filter):
    """Drops Orbax's ``Given directory is read only=DIR``: a WARNING that CheckpointManager
    logs whenever it is opened with ``read_only=True``, which is how a checkpoint is only
    looked at (the run-dir probe before every run, eval.py, convert.py); the directory is
    usually writable and nothing is wrong."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith("Given directory is read only")


@contextlib.contextmanager
def _quiet_read_only_notice(read_only: bool) -> Iterator[None]:
    if not read_only:
        yield
        return
    absl_logger, notice = logging.getLogger("absl"), _DropReadOnlyNotice()
    absl_logger.addFilter(notice)
    try:
        yield
    finally:
        absl_logger.removeFilter(notice)


class TrainCheckpointer:
    """Saves and restores the learner's training state in ``directory`` (local or gs://).

    Keeps the newest ``keep`` checkpoints. ``save`` is asynchronous unless
    ``async_save=False``; call ``wait()`` before relying on it being on disk.
    """

    @classmethod
    def from_config(cls, checkpoint: CheckpointConfig, directory: str) -> TrainCheckpointer:
        """The run's checkpointer in ``directory``, from its ``checkpoint`` section."""
        return cls(directory, keep=checkpoint.keep, async_save=checkpoint.async_save)

    def __init__(self, directory: str | os.PathLike, *, keep: int = 3, async_save: bool = True,
                 read_only: bool = False):
        directory = os.fspath(directory)
        if not isinstance(keep, int) or keep < 1:
            raise ValueError(f"TrainCheckpointer keep must be an int >= 1, got {keep!r}")
        require_gcs_support(directory)
        if not _is_url(directory):
            directory = os.path.abspath(directory)
            if read_only and not os.path.isdir(directory):
                raise CheckpointError(f"checkpoint directory {directory} does not exist")
            if os.path.exists(directory) and not os.path.isdir(directory):
                raise CheckpointError(f"checkpoint directory {directory} is a file")
        self.directory = directory
        options = ocp.CheckpointManagerOptions(
            max_to_keep=None if read_only else keep,
            save_interval_steps=0 if read_only else 1,
            enable_async_checkpointing=async_save,
            create=not read_only,
            read_only=read_only,
            # Leftover tmp dirs of a killed save are ignored, and removed before the next save.
            cleanup_tmp_directories=not read_only,
        )
        with _quiet_read_only_notice(read_only):
            self._manager = ocp.CheckpointManager(directory, options=options,
                                                  item_handlers=_item_handlers())
        if not read_only and _SAVE_ERRORS_FILTER not in logging.getLogger("absl").filters:
            logging.getLogger("absl").addFilter(_SAVE_ERRORS_FILTER)

    def _write_error(self, e: Exception) -> CheckpointWriteError:
        """One line for a failed save: the directory, the reason ("No space left on device"
        rather than Orbax's tensorstore text), and the newest complete checkpoint."""
        text = " ".join(str(e).split())
        if "No space left on device" in text or getattr(e, "errno", None) == errno.ENOSPC:
            reason = "No space left on device"
        else:
            reason = f"{type(e).__name__}: {text[:300]}"
        newest: int | None = None
        with contextlib.suppress(Exception):
            newest = self.latest_step()
        kept = (f"the newest complete checkpoint is step {newest}" if newest is not None
                else "no complete checkpoint is there yet")
        return CheckpointWriteError(f"checkpoint directory {self.directory}: a checkpoint "
                                    f"could not be written ({reason}); {kept}")

    # ------------------------------------------------------------------ save
    def save(self, step: int, params: PyTree, opt_state: PyTree | None, meta: CheckpointMeta,
             *, force: bool = False) -> bool:
        """Starts saving checkpoint ``step``; returns True if a save was started.

        ``opt_state=None`` saves params only (e.g. a converted HF model); the saved meta
        says which (``has_opt_state``). A step that
        already exists is an error, never overwritten. ``force`` is passed to Orbax's
        save policy (every step is eligible here, so it rarely matters).
        """
        if not isinstance(step, int | np.integer) or step < 0:
            raise ValueError(f"checkpoint step must be an int >= 0, got {step!r}")
        step = int(step)
        if step in self.all_steps():
            raise CheckpointError(f"{self.directory}: checkpoint step {step} already exists")
        if not isinstance(meta, CheckpointMeta):
            raise TypeError(f"checkpoint meta must be a CheckpointMeta, got "
                            f"{type(meta).__name__}")
        meta_json = dataclasses.replace(meta, has_opt_state=opt_state is not None).to_json()
        items: dict[str, ocp.args.CheckpointArgs] = {
            PARAMS: ocp.args.StandardSave(_to_pure(params)),
            META: ocp.args.JsonSave(meta_json),
        }
        if opt_state is not None:
            items[OPT_STATE] = ocp.args.StandardSave(_to_pure(opt_state))
        try:  # an earlier async save's failure surfaces here too
            return bool(self._manager.save(step, args=ocp.args.Composite(**items), force=force))
        except (OSError, ValueError, RuntimeError) as e:
            raise self._write_error(e) from None

    def wait(self) -> None:
        """Blocks until every started save is durable (and raises if one failed: a
        :class:`CheckpointWriteError`)."""
        try:
            self._manager.wait_until_finished()
            self._manager.check_for_errors()
        except (OSError, ValueError, RuntimeError) as e:
            raise self._write_error(e) from None

    # --------------------------------------------------------------- queries
    def all_steps(self) -> list[int]:
        """Committed checkpoint steps, oldest first (ignores unfinished tmp dirs)."""
        return sorted(int(s) for s in self._manager.all_steps())

    def latest_step(self) -> int | None:
        steps = self.all_steps()
        return steps[-1] if steps else None

    def _resolve_step(self, step: int | None) -> int:
        steps = self.all_steps()
        if step is None:
            if not steps:
                raise CheckpointError(f"no checkpoint found in {self.directory}")
            return steps[-1]
        if int(step) not in steps:
            raise CheckpointError(
                f"checkpoint step {step} not found in {self.directory}; available steps: {steps}"
            )
        return int(step)

    def restore_meta(self, step: int | None = None) -> CheckpointMeta:
        """Only the ``meta`` item of checkpoint ``step`` (default: latest)."""
        step = self._resolve_step(step)
        args = ocp.args.Composite(**{META: ocp.args.JsonRestore()})
        restored = self._manager.restore(step, args=args)
        return CheckpointMeta.from_json(restored[META])

    # --------------------------------------------------------------- restore
    def restore(self, step: int | None = None, *, params_target: PyTree | None = None,
                opt_state_target: PyTree | None = None, params_only: bool = False
                ) -> tuple[PyTree, PyTree | None, CheckpointMeta]:
        """Returns ``(params, opt_state, meta)`` of checkpoint ``step`` (default: latest).

        A target (PyTree of arrays or ``jax.ShapeDtypeStruct`` with shardings, or an
        ``nnx.State``, or an optax state holding ``nnx.State``s) fixes the structure,
        dtypes and device placement of the result, which comes back in the target's own
        container types. Without a target the result is a pure PyTree on the
        default device. ``opt_state`` is None for a
        params-only checkpoint, and with ``params_only`` (evaluation, conversion: the
        optimizer state, ~2x the params in fp32, is then never read).
        """
        step = self._resolve_step(step)
        where = f"{self.directory}/{step}"
        saved = self._manager.item_metadata(step)
        meta = self.restore_meta(step)
        has_opt = (meta.has_opt_state if meta.has_opt_state is not None
                   else saved.get(OPT_STATE) is not None)
        if params_only:
            if opt_state_target is not None:
                raise ValueError("restore(params_only=True) takes no opt_state_target")
            has_opt = False
        if saved.get(PARAMS) is None:
            raise CheckpointError(f"{where} has no params item")
        if opt_state_target is not None and not has_opt:
            raise CheckpointError(f"{where} holds params only (no optimizer state) but an "
                                  f"opt_state_target was given")

        def prepare(item: str, target: PyTree | None) -> PyTree:
            saved_tree = saved[item].tree
            if target is None:
                return _default_target(saved_tree)
            abstract = _abstract(_to_pure(target))
            _check_target(saved_tree, abstract, item, where)
            return abstract

        items = {PARAMS: ocp.args.StandardRestore(prepare(PARAMS, params_target))}
        if has_opt:
            items[OPT_STATE] = ocp.args.StandardRestore(prepare(OPT_STATE, opt_state_target))
        try:
            restored = self._manager.restore(step, args=ocp.args.Composite(**items))
        except (ValueError, KeyError, FileNotFoundError) as e:
            raise CheckpointError(f"{where}: failed to restore: {e}") from e
        params = _back_to_target(restored[PARAMS], params_target)
        opt_state = _back_to_target(restored[OPT_STATE], opt_state_target) if has_opt else None
        return params, opt_state, meta

    def restore_newest(self, *, params_target: PyTree | None = None,
                       opt_state_target: PyTree | None = None, params_only: bool = False
                       ) -> tuple[int, PyTree, PyTree | None, CheckpointMeta,
                                  list[tuple[int, str]]]:
        """Restores the newest checkpoint that restores (``restore``'s keyword arguments):
        ``(step, params, opt_state, meta, skipped)``, ``skipped`` the newer steps that did
        not, each with why (a truncated file, a missing array file, a broken metadata
        file...). Raises CheckpointError naming every step and its cause when none
        restores. Reads only: nothing is removed."""
        skipped: list[tuple[int, str]] = []
        _quiet_closed_loop_callbacks()  # what a failing restore leaves behind
        for step in reversed(self.all_steps()):
            try:
                params, opt_state, meta = self.restore(
                    step, params_target=params_target, opt_state_target=opt_state_target,
                    params_only=params_only)
            except Exception as e:  # noqa: BLE001 - orbax/tensorstore raise many kinds
                cause = e.__cause__ if isinstance(e, CheckpointError) and e.__cause__ else e
                text = " ".join(str(cause).split())
                skipped.append((step, f"{type(cause).__name__}: {text[:300]}"))
                continue
            return step, params, opt_state, meta, skipped
        if not skipped:
            raise CheckpointError(f"no checkpoint found in {self.directory}")
        detail = "; ".join(f"step {s}: {why}" for s, why in skipped)
        raise CheckpointError(f"no checkpoint in {self.directory} can be restored ({detail})")

    def reload(self) -> None:
        """Re-reads the directory's steps (after another process changed them)."""
        self._manager.reload()

    def set_aside(self, step: int) -> str:
        """Renames checkpoint ``step`` to ``<step>.unrestorable`` (kept, for a look; no
        longer a step, so the run can save that version again). Returns the new path."""
        src = storage.join(self.directory, str(step))
        dst = f"{src}.unrestorable"
        n = 1
        while storage.exists(dst):
            n += 1
            dst = f"{src}.unrestorable{n}"
        if _is_url(self.directory):
            fs, path = storage.filesystem(src)
            fs.mv(path, storage.filesystem(dst)[1], recursive=True)
        else:
            os.rename(src, dst)
        self.reload()
        return dst

    def close(self) -> None:
        """Waits for pending saves, then releases the manager."""
        self._manager.wait_until_finished()
        self._manager.close()

    def __enter__(self) -> TrainCheckpointer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _quiet_closed_loop_callbacks() -> None:
    """After a failed Orbax restore, tensorstore reads still in flight complete into the
    restore's event loop, closed by then; Python prints each as an "Exception ignored ...
    Event loop is closed" traceback. Those (and only those) are dropped from now on."""
    previous = sys.unraisablehook
    if getattr(previous, "_drops_closed_loop", False):
        return

    def hook(unraisable: sys.UnraisableHookArgs) -> None:
        e = unraisable.exc_value
        if not (isinstance(e, RuntimeError) and str(e) == "Event loop is closed"):
            previous(unraisable)

    hook._drops_closed_loop = True  # type: ignore[attr-defined]
    sys.unraisablehook = hook


def _back_to_target(restored_pure: PyTree, target: PyTree | None) -> PyTree:
    """The restored arrays in the target's own containers (nnx.State, optax tuples...).

    ``restored_pure`` has the structure of ``_to_pure(target)``, whose leaves come in the
    same order as the target's.
    """
    if target is None:
        return restored_pure
    leaves = jax.tree.leaves(restored_pure)
    structure = jax.tree.structure(target)
    n_target = len(jax.tree.leaves(target))
    if n_target != len(leaves):
        raise CheckpointError(f"internal: restored {len(leaves)} arrays for a target with "
                              f"{n_target}")
    return jax.tree.unflatten(structure, leaves)
