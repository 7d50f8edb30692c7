"""The records of a ``polyaccel train`` save agree, and one run at a time writes a ``--save`` directory.

A save writes two records: the engine's checkpoint folder ``<tag>/`` (whose ``meta.json`` keeps the run's
metadata as client state, and the engine's run id) and ``train-meta-<tag>.json`` beside it (the same metadata,
with that run id). Resuming compares them before any rank starts: a folder of one run beside the metadata file
of another (other seeds, other weights) is refused, naming what differs. The run holds an exclusive lock on its
``--save`` directory (:mod:`polyaccel.dir_lock`) for its whole length, so a second run writing
there at the same time is refused before it starts instead of interleaving its checkpoints with the first's.
"""

from __future__ import annotations

import contextlib

from polyaccel.errors import CheckpointError, ConfigError

#: the lock file a run holds in its --save directory
TRAIN_LOCK = ".polyaccel-train.lock"


def claim_save_dir(save: str | None):
    """A held lock on ``save`` (release it, or use it as a context manager), or a no-op without ``--save``;
    :class:`ConfigError` when another run holds it."""
    if not save:
        return contextlib.nullcontext()
    from pathlib import Path

    from polyaccel.dir_lock import DirectoryLock, LockHeld

    Path(save).mkdir(parents=True, exist_ok=True)
    try:
        return DirectoryLock(save, TRAIN_LOCK, "polyaccel train --save").acquire()
    except LockHeld as exc:
        raise ConfigError(f"--save {save}: {exc}; wait for that run to end, or pass another --save directory") from None


def differences(train_meta: dict, saved: dict | None) -> list[str]:
    """How the checkpoint's copy of the run metadata (``saved``, its client state) differs from the file's."""
    if not isinstance(saved, dict):
        return ["the checkpoint holds no run metadata (it was not saved by `polyaccel train`)"]
    keys = sorted(set(train_meta) | set(saved))
    return [f"{k}: {train_meta.get(k)!r} in the metadata file, {saved.get(k)!r} in the checkpoint"
            for k in keys if train_meta.get(k) != saved.get(k)]


def check_records_agree(directory: str, tag: str, train_meta: dict) -> None:
    """The checkpoint folder ``tag`` in ``directory`` was saved with ``train_meta`` (its ``meta.json`` read and its
    checksum checked); else :class:`ConfigError` naming the differences. A folder without ``meta.json`` is left to
    the ranks' load, which refuses it naming the missing file."""
    from pathlib import Path

    from polyaccel.engines.zero import complete_tags, read_meta, resolve_tag

    if tag not in complete_tags(Path(directory)):
        return  # no folder to compare with: the ranks' load refuses it, naming what is missing
    try:
        folder = resolve_tag(directory, tag)
        meta = read_meta(folder)
    except CheckpointError as exc:
        raise ConfigError(f"--resume {directory}: {exc}") from None
    diff = differences(train_meta, (meta.get("client_state") or {}).get("train"))
    if diff:
        raise ConfigError(f"--resume {directory}: checkpoint {tag!r} and its train-meta-{tag}.json come from two "
                          f"different runs ({'; '.join(diff[:3])}); restore the pair from one run, or pick another "
                          "--resume-tag")


__all__ = ["TRAIN_LOCK", "check_records_agree", "claim_save_dir", "differences"]
