"""Sharded ZeRO checkpoints, written atomically, loadable at any world size and stage.

Save protocol (every rank calls it; all file names are in :mod:`.consolidate`):

1. rank 0 makes an empty staging folder ``<dir>/.<tag>.partial``; barrier;
2. each rank writes its partition file under a temporary name, fsyncs it and renames it;
   rank 0 also writes the model states (frozen parameters, buffers); barrier;
3. rank 0 writes ``meta.json`` the same way, renames the staging folder to ``<dir>/<tag>``,
   fsyncs the directory and only then replaces ``latest`` (temporary file, fsync, rename).

A crash anywhere before step 3's last rename leaves ``latest`` naming the previous complete
checkpoint; a half-written staging folder is ignored and removed by the next save.

Loading reads the tag from ``latest`` (or the one given). At the same world size, stage and
layout each rank reads its own file; otherwise every rank rebuilds full per-parameter
tensors from all shards and cuts its new partition out of them (resharding).
"""

from __future__ import annotations

import json
import shutil
import uuid
from pathlib import Path

import torch
from polyaccel.dir_lock import DirectoryLock, LockHeld
from polyaccel.errors import CheckpointError, InvalidArgument, PolyaccelError
from polyaccel.parallel import get_layout
from polyaccel.safe_files import (
    ALGORITHM,
    CHUNK_BYTES,
    replace_folder,
    write_atomic,
    write_checked_json,
    write_text,
)

from .consolidate import (
    FIX,
    FORMAT,
    LATEST,
    META,
    MODEL_STATES,
    Shard,
    check_files,
    check_tag,
    full_tensors,
    full_tensors_any,
    group_id,
    layout_from_meta,
    rank_file,
    read_latest,
    read_meta,
    read_model_states,
    resolve_tag,
    saved_files,
    verify_files,
)
from .integrity import write_safetensors
from .model_check import check_fits, trainable_shapes
from .partition import FlatLayout

#: test hook: called with a phase name ("rank_files", "commit"); raising there simulates a crash
_FAULT = None


def _fault(phase: str) -> None:
    if _FAULT is not None:
        _FAULT(phase)


#: bytes of one rank's status record in :func:`_agree` (JSON, zero-padded)
_AGREE_BYTES = 4096


def _agree(coll, record: dict) -> list[dict]:
    """Every rank's ``record`` (small JSON), on every rank: one all-reduce of a [world, _AGREE_BYTES] tensor.

    Save and load phases end with it instead of a barrier, so a rank that failed tells the others
    (they raise the same error instead of waiting forever at the next barrier).
    """
    raw = json.dumps(record).encode()
    if len(raw) > _AGREE_BYTES:  # only an error message can be that long
        raw = json.dumps({**record, "error": record.get("error", "")[:1000]}).encode()[:_AGREE_BYTES]
    rows = torch.zeros(coll.world, _AGREE_BYTES, dtype=torch.int64)
    rows[coll.rank, :len(raw)] = torch.frombuffer(bytearray(raw), dtype=torch.uint8).to(torch.int64)
    rows = coll.all_reduce(rows) if coll.world > 1 else rows
    out = []
    for r in range(coll.world):
        row = bytes(rows[r].to(torch.uint8).tolist()).rstrip(b"\0")
        try:
            out.append(json.loads(row))
        except json.JSONDecodeError:
            out.append({"error": f"rank {r} sent an unreadable status"})
    return out


def _raise_first(records: list[dict], what: str) -> None:
    """Raise the first rank's error among ``records`` (the same error on every rank)."""
    for r, rec in enumerate(records):
        if rec.get("error"):
            where = f" (on rank {r})" if len(records) > 1 else ""
            raise CheckpointError(f"{what}{where}: {rec['error']}", rec.get("path"))


def raise_if_any_failed(coll, exc: BaseException | None, what: str) -> None:
    """Collective: every rank of ``coll`` raises the same :class:`CheckpointError` when any rank passes an
    exception (the first such rank's, prefixed by ``what``); returns on every rank when none did."""
    _raise_first(_agree(coll, _error_record(exc) if exc is not None else {}), what)


def _error_record(exc: BaseException) -> dict:
    path = getattr(exc, "path", None) or getattr(exc, "filename", None)
    if isinstance(exc, OSError):
        text = f"{exc.strerror or exc}" + (f": {exc.filename}" if exc.filename else "")
    elif isinstance(exc, PolyaccelError):
        text = str(exc)
    else:
        text = f"{type(exc).__name__}: {exc}"
    return {"error": text, "path": str(path) if path else None}


def _layout_meta(engine) -> dict:
    lay = engine.partitioner.layout
    meta = {"names": lay.names, "shapes": [list(s) for s in lay.shapes]}
    if isinstance(lay, FlatLayout):
        meta["bucket_chunk"] = lay.bucket_chunk
    return meta


def _is_grouped(engine) -> bool:
    """Version 2 (per-rank group records) whenever a mesh or several parameter groups are involved."""
    return engine.mesh is not None or len(engine.groups) > 1


def _group_meta(engine, g) -> dict:
    lay = g.partitioner.layout
    splits = {}
    for name, p in g.entries:
        sp = get_layout(p).split
        if sp is not None:
            splits[name] = {"dim": sp.dim, "axis": sp.axis, "sections": [list(x) for x in sp.sections], "rank": sp.rank}
    out = {"key": list(g.key), "names": lay.names, "shapes": [list(x) for x in lay.shapes],
           "ranks": g.coll.global_ranks(), "splits": splits}
    if isinstance(lay, FlatLayout):
        out["bucket_chunk"] = lay.bucket_chunk
    return out


def _model_states(engine) -> dict[str, torch.Tensor]:
    """Frozen parameters (gathered in stage 3) and persistent buffers, on the host."""
    out = {}
    if engine.frozen:
        if engine.stage == 3:
            full = engine.partitioner.full_params()
            out.update({n: full[n] for n, _ in engine.frozen})
        else:
            out.update({n: p.detach() for n, p in engine.frozen})
    persistent = set(engine.module.state_dict().keys())
    for name, buf in engine.module.named_buffers():
        if name in persistent and buf is not None:
            out[name] = buf.detach()
    return {k: v.to("cpu").contiguous().clone() for k, v in out.items()}


def _tensors_to_save(engine) -> tuple[dict, dict]:
    """(tensors, safetensors metadata) of this rank's partition file."""
    rank = engine.rank
    if _is_grouped(engine):
        tensors, groups = {}, []
        for g in engine.groups:
            gid = group_id(g.key)
            tensors[f"{gid}/master"] = g.partitioner.master.detach().cpu()
            for name, t in g.optimizer.state.items():
                tensors[f"{gid}/{name}"] = t.detach().cpu()
            groups.append(_group_meta(engine, g))
        return tensors, {"rank": str(rank), "format": FORMAT, "groups": json.dumps(groups)}
    tensors = {"master": engine.partitioner.master.detach().cpu()}
    for name, t in engine.optimizer.state.items():
        tensors[name] = t.detach().cpu()
    return tensors, {"rank": str(rank), "format": FORMAT}


def _meta(engine, tag: str, client_json: str, files: dict) -> dict:
    grouped = _is_grouped(engine)
    return {
        "format": FORMAT, "version": 2 if grouped else 1, "tag": tag, "run_id": run_id(engine),
        "zero_stage": engine.stage,
        "world_size": engine.world_size,
        "global_steps": engine.global_steps, "micro_steps": engine.micro_steps,
        "skipped_steps": engine.skipped_steps, "optimizer_type": engine.config.optimizer.type,
        "optimizer_step": engine.optimizer.step_count, "lr": engine.optimizer.lr,
        "state_names": sorted(engine.optimizer.state), "loss_scaler": engine.scaler.state_dict(),
        "compute_dtype": str(engine.compute_dtype).removeprefix("torch."),
        "master_dtype": str(engine.master_dtype).removeprefix("torch."),
        "layout": None if grouped else _layout_meta(engine), "params": trainable_shapes(engine),
        "frozen": [n for n, _ in engine.frozen],
        "aliases": engine.aliases,
        "state_dict_keys": list(engine.module.state_dict().keys()), "config": engine.config.raw,
        "client_state": json.loads(client_json),
        "integrity": {"algorithm": ALGORITHM, "chunk_bytes": CHUNK_BYTES}, "files": files,
    }


#: the lock file a save holds in its directory (:mod:`polyaccel.dir_lock`): never two saves into one at once
SAVE_LOCK = ".polyaccel-save.lock"


def run_id(engine) -> str:
    """The engine's run identity: a random id made at its first save, written into every ``meta.json`` it saves
    (and by the train app into its ``train-meta-<tag>.json``), so that two records of one save can be matched."""
    rid = getattr(engine, "checkpoint_run_id", None)
    if rid is None:
        rid = engine.checkpoint_run_id = uuid.uuid4().hex
    return rid


def save(engine, save_dir, tag=None, client_state=None) -> str:
    lock = DirectoryLock(save_dir, SAVE_LOCK, f"a save of checkpoint {tag!r}") if engine.rank == 0 else None
    try:
        return _save(engine, save_dir, tag, client_state, lock)
    finally:
        if lock is not None:
            lock.release()


def _save(engine, save_dir, tag, client_state, lock) -> str:
    tag = check_tag(tag) if tag is not None else f"global_step{engine.global_steps}"
    if (Path(save_dir) / tag).exists() and not (Path(save_dir) / tag).is_dir():
        raise InvalidArgument(f"checkpoint tag {tag!r}: {Path(save_dir) / tag} is a file, not a checkpoint folder; "
                              "a tag names a folder of its own: pass another tag")
    try:
        client_json = json.dumps(client_state if client_state is not None else {})
    except TypeError as exc:
        raise PolyaccelError(f"client_state must be JSON-serialisable (numbers, strings, lists, dicts): {exc}") from exc
    root = Path(save_dir)
    staging = root / f".{tag}.partial"
    coll, rank = engine.coll, engine.rank
    what = f"saving checkpoint {tag!r} in {str(root)!r} failed"
    model_states = _model_states(engine)  # collective in stage 3: every rank takes part
    status: dict = {}
    before = _latest_note(root)  # said by every error: what 'latest' named before this save touched anything
    if rank == 0:
        try:
            root.mkdir(parents=True, exist_ok=True)
            lock.acquire()  # before anything is written: a second writer is refused here
            if staging.exists():
                shutil.rmtree(staging)
            staging.mkdir()
        except LockHeld as exc:
            status = {"error": f"{exc}; wait for it to finish, or save elsewhere; nothing was changed",
                      "path": str(exc.path)}
        except OSError as exc:
            status = _error_record(exc)
    _raise_first(_agree(coll, status), what)

    files: dict = {}
    try:
        tensors, file_meta = _tensors_to_save(engine)
        name = rank_file(rank)
        files[name] = write_atomic(staging / name, lambda tmp: write_safetensors(tmp, tensors, file_meta))
        tensors = None  # the host copies of the partition go now, before rank 0 writes the model states
        if rank == 0:
            files[MODEL_STATES] = write_atomic(
                staging / MODEL_STATES, lambda tmp: write_safetensors(tmp, model_states, {"format": "pt"}))
        status = {"files": files}
    except Exception as exc:  # noqa: BLE001 - every failure to write becomes the same error on every rank
        status = _error_record(exc)
    _fault("rank_files")
    records = _agree(coll, status)
    try:
        _raise_first(records, what)
    except CheckpointError as exc:
        if rank == 0:
            shutil.rmtree(staging, ignore_errors=True)
        coll.barrier()  # every rank failed here: none returns before the staging folder is gone
        raise CheckpointError(f"{exc}; nothing was changed, {before}", exc.path) from None

    status = {}
    if rank == 0:
        try:
            all_files = {k: v for rec in records for k, v in rec["files"].items()}
            write_checked_json(staging / META, _meta(engine, tag, client_json, all_files))
            _fault("commit")
            _commit(root, staging, tag)
        except Exception as exc:  # noqa: BLE001
            shutil.rmtree(staging, ignore_errors=True)
            status = _error_record(exc)
            status["error"] = f"{status['error']}; {_after_failed_commit(root, before)}"
    _raise_first(_agree(coll, status), what)
    return tag


def _latest_note(root: Path) -> str:
    latest = root / LATEST
    if not latest.exists():
        return "no checkpoint was there before"
    try:
        return f"'latest' still names {read_latest(root)!r}"
    except CheckpointError:
        return f"{latest} was already unreadable before this save"


def _after_failed_commit(root: Path, before: str) -> str:
    """What a failed commit left: ``before`` when 'latest' names what it named then, else what it names now."""
    now = _latest_note(root)
    if now == before:
        return before
    return f"{now.replace('still names', 'now names')} (before this save: {before.replace('still names', 'named')})"


def _commit(root: Path, staging: Path, tag: str) -> None:
    """Move the staged folder into place, then point ``latest`` at it (the last step)."""
    old = root / f".{tag}.old"  # the previous folder of this tag until 'latest' is written (see resolve_tag)
    replace_folder(staging, root / tag, aside=old)
    write_text(root / LATEST, tag)
    if old.exists():
        shutil.rmtree(old)


def _files_read(engine, meta: dict) -> list[str]:
    """The saved files this rank reads: its own partition (same world, stage and layout), or all of them."""
    if not (_is_grouped(engine) or meta.get("version", 1) >= 2) and _same_layout(engine, meta):
        return [rank_file(engine.rank), MODEL_STATES]
    return saved_files(meta)


def _open_for_load(engine, load_dir, tag) -> tuple[Path, dict]:
    """(folder, meta) once every rank found its files there, at their sizes and, unless
    ``checkpoint.verify`` is false, matching their checksums; else the same error on every rank."""
    verify = engine.config.checkpoint_verify
    folder = meta = None
    status: dict = {}
    try:
        folder = resolve_tag(load_dir, tag)
        meta = read_meta(folder, verify)
        check_files(folder, meta)
        if verify:
            verify_files(folder, meta, _files_read(engine, meta))
        check_fits(engine, folder, meta)
    except (CheckpointError, OSError) as exc:
        status = _error_record(exc)
    _raise_first(_agree(engine.coll, status), f"cannot load checkpoint from {str(load_dir)!r}")
    return folder, meta


@torch.no_grad()
def load(engine, load_dir, tag=None):
    folder, meta = _open_for_load(engine, load_dir, tag)
    family = {"adam": "adam", "adamw": "adam", "lion": "lion", "lamb": "lamb", "muon": "muon"}
    if family[meta["optimizer_type"]] != family[engine.config.optimizer.type]:
        raise PolyaccelError(
            f"checkpoint {folder} holds {meta['optimizer_type']!r} optimizer state; this engine uses "
            f"{engine.config.optimizer.type!r} (set optimizer.type to match)")
    if _is_grouped(engine) or meta.get("version", 1) >= 2:
        _load_grouped(engine, folder, meta)
    else:
        _load_flat(engine, folder, meta)
    _load_model_states(engine, read_model_states(folder))
    for g in engine.groups:
        g.partitioner.publish()
        g.partitioner.zero_grad()
    engine.global_steps = meta["global_steps"]
    engine.micro_steps = meta["micro_steps"]
    engine.skipped_steps = meta["skipped_steps"]
    for g in engine.groups:
        g.optimizer.step_count = meta["optimizer_step"]
        g.optimizer.lr = meta["lr"]
    engine.scaler.load_state_dict(meta["loss_scaler"])
    engine.coll.barrier()
    return meta["client_state"]


def _load_grouped(engine, folder: Path, meta: dict) -> None:
    """Any layout into any layout: full tensors from the checkpoint, cut to this rank's pieces and partitions."""
    keys = ["master", *sorted(engine.optimizer.state)]
    for k in keys:
        full = full_tensors_any(folder, meta, k)
        for g in engine.groups:
            lay = g.partitioner.layout
            missing = set(lay.names) - set(full)
            if missing:
                raise PolyaccelError(f"checkpoint {folder} lacks trainable parameters {sorted(missing)[:5]}")
            local = {}
            for name, p in g.entries:
                t = full[name]
                sp = get_layout(p).split
                if sp is not None:
                    if t.shape[sp.axis] != sp.full_length:
                        raise PolyaccelError(
                            f"checkpoint {folder}: {name!r} has {t.shape[sp.axis]} rows along axis {sp.axis} but the "
                            f"model splits {sp.full_length} over {sp.dim}; was it saved from another model?")
                    t = sp.piece(t)
                if tuple(t.shape) != tuple(p.shape) and p.numel() == t.numel() and engine.stage < 3:
                    raise PolyaccelError(f"checkpoint {folder}: {name!r} has shape {tuple(t.shape)}, the model "
                                         f"expects {tuple(p.shape)}")
                local[name] = t
            target = g.partitioner.master if k == "master" else g.optimizer.state[k]
            rank = g.coll.rank
            if isinstance(lay, FlatLayout):
                target.copy_(lay.partition_of(lay.flatten(local, target.dtype), rank))
            else:
                target.copy_(lay.partition_of(local, rank, target.dtype))


def _same_layout(engine, meta: dict) -> bool:
    return (meta["world_size"] == engine.world_size and meta["zero_stage"] in ((1, 2) if engine.stage < 3 else (3,))
            and _layout_meta(engine) == meta["layout"])


def _load_flat(engine, folder: Path, meta: dict) -> None:
    lay = engine.partitioner.layout
    same = _same_layout(engine, meta)
    keys = ["master", *sorted(engine.optimizer.state)]
    targets = {"master": engine.partitioner.master, **engine.optimizer.state}
    if same:
        with Shard(folder / rank_file(engine.rank)) as f:
            for k in keys:
                t = f.get_tensor(k)
                if t.shape != targets[k].shape:
                    raise CheckpointError(f"{f.path}: {k!r} has shape {tuple(t.shape)}, this rank's partition "
                                          f"is {tuple(targets[k].shape)}; the file comes from another save; {FIX}",
                                          f.path)
                targets[k].copy_(t)
    else:
        names = set(lay.names)
        for k in keys:
            full = full_tensors(folder, meta, k)
            missing = names - set(full)
            if missing:
                raise PolyaccelError(f"checkpoint {folder} lacks trainable parameters {sorted(missing)[:5]}")
            dtype = targets[k].dtype
            if isinstance(lay, FlatLayout):
                part = lay.partition_of(lay.flatten(full, dtype), engine.rank)
            else:
                part = lay.partition_of(full, engine.rank, dtype)
            targets[k].copy_(part)


def _load_model_states(engine, states: dict[str, torch.Tensor]) -> None:
    for name, p in engine.frozen:
        if name not in states:
            raise PolyaccelError(f"checkpoint lacks the frozen parameter {name!r}")
        if engine.stage == 3:
            engine.partitioner.load_full(p, states[name])
        else:
            p.data.copy_(states[name])
    for name, buf in engine.module.named_buffers():
        if name in states:
            buf.copy_(states[name])


__all__ = ["layout_from_meta", "load", "save"]
