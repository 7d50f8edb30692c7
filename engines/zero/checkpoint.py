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
import os
import shutil
from pathlib import Path

import torch
from polyaccel.errors import PolyaccelError
from polyaccel.parallel import get_layout
from safetensors.torch import save_file

from .consolidate import (
    FORMAT,
    LATEST,
    META,
    MODEL_STATES,
    full_tensors,
    full_tensors_any,
    group_id,
    layout_from_meta,
    rank_file,
    read_meta,
    read_model_states,
    resolve_tag,
)
from .partition import FlatLayout

#: test hook: called with a phase name ("rank_files", "commit"); raising there simulates a crash
_FAULT = None


def _fault(phase: str) -> None:
    if _FAULT is not None:
        _FAULT(phase)


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(str(path), os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_atomic(path: Path, write) -> None:
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    write(tmp)
    with open(tmp, "rb") as f:
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _write_text(path: Path, text: str) -> None:
    def write(tmp):
        with open(tmp, "w") as f:
            f.write(text)
    _write_atomic(path, write)


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


def save(engine, save_dir, tag=None, client_state=None) -> str:
    tag = str(tag) if tag is not None else f"global_step{engine.global_steps}"
    if "/" in tag or tag.startswith("."):
        raise PolyaccelError(f"checkpoint tag {tag!r} must be a plain name (no '/', not starting with '.')")
    try:
        client_json = json.dumps(client_state if client_state is not None else {})
    except TypeError as exc:
        raise PolyaccelError(f"client_state must be JSON-serialisable (numbers, strings, lists, dicts): {exc}") from exc
    root = Path(save_dir)
    staging = root / f".{tag}.partial"
    coll, rank = engine.coll, engine.rank
    model_states = _model_states(engine)  # collective in stage 3: every rank takes part
    if rank == 0:
        root.mkdir(parents=True, exist_ok=True)
        if staging.exists():
            shutil.rmtree(staging)
        staging.mkdir()
    coll.barrier()

    grouped = _is_grouped(engine)
    if grouped:
        tensors, groups = {}, []
        for g in engine.groups:
            gid = group_id(g.key)
            tensors[f"{gid}/master"] = g.partitioner.master.detach().cpu()
            for name, t in g.optimizer.state.items():
                tensors[f"{gid}/{name}"] = t.detach().cpu()
            groups.append(_group_meta(engine, g))
        file_meta = {"rank": str(rank), "format": FORMAT, "groups": json.dumps(groups)}
    else:
        tensors = {"master": engine.partitioner.master.detach().cpu()}
        for name, t in engine.optimizer.state.items():
            tensors[name] = t.detach().cpu()
        file_meta = {"rank": str(rank), "format": FORMAT}
    _write_atomic(staging / rank_file(rank), lambda tmp: save_file(tensors, str(tmp), metadata=file_meta))
    if rank == 0:
        _write_atomic(staging / MODEL_STATES, lambda tmp: save_file(model_states, str(tmp), metadata={"format": "pt"}))
    _fault("rank_files")
    coll.barrier()

    if rank == 0:
        meta = {
            "format": FORMAT, "version": 2 if grouped else 1, "tag": tag, "zero_stage": engine.stage,
            "world_size": engine.world_size,
            "global_steps": engine.global_steps, "micro_steps": engine.micro_steps,
            "skipped_steps": engine.skipped_steps, "optimizer_type": engine.config.optimizer.type,
            "optimizer_step": engine.optimizer.step_count, "lr": engine.optimizer.lr,
            "state_names": sorted(engine.optimizer.state), "loss_scaler": engine.scaler.state_dict(),
            "compute_dtype": str(engine.compute_dtype).removeprefix("torch."),
            "master_dtype": str(engine.master_dtype).removeprefix("torch."),
            "layout": None if grouped else _layout_meta(engine), "frozen": [n for n, _ in engine.frozen],
            "aliases": engine.aliases,
            "state_dict_keys": list(engine.module.state_dict().keys()), "config": engine.config.raw,
            "client_state": json.loads(client_json),
        }
        _write_text(staging / META, json.dumps(meta, indent=1))
        _fault("commit")
        final = root / tag
        old = root / f".{tag}.old"
        if final.exists():
            if old.exists():
                shutil.rmtree(old)
            os.replace(final, old)
        os.replace(staging, final)
        _fsync_dir(root)
        _write_text(root / LATEST, tag)
        _fsync_dir(root)
        if old.exists():
            shutil.rmtree(old)
    coll.barrier()
    return tag


@torch.no_grad()
def load(engine, load_dir, tag=None):
    folder = resolve_tag(load_dir, tag)
    meta = read_meta(folder)
    family = {"adam": "adam", "adamw": "adam", "lion": "lion", "lamb": "lamb"}
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


def _load_flat(engine, folder: Path, meta: dict) -> None:
    lay = engine.partitioner.layout
    same = (meta["world_size"] == engine.world_size and meta["zero_stage"] in ((1, 2) if engine.stage < 3 else (3,))
            and _layout_meta(engine) == meta["layout"])
    keys = ["master", *sorted(engine.optimizer.state)]
    targets = {"master": engine.partitioner.master, **engine.optimizer.state}
    if same:
        from safetensors import safe_open

        with safe_open(str(folder / rank_file(engine.rank)), framework="pt") as f:
            for k in keys:
                targets[k].copy_(f.get_tensor(k))
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
