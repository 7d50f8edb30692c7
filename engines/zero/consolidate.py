"""Read a ZeRO checkpoint offline and rebuild full tensors (the ``zero-to-fp32`` conversion).

A checkpoint directory holds ``latest`` (the newest complete tag) and one folder per tag:
``meta.json`` (stage, world size, partition layout, counters, client state),
``model_states.safetensors`` (frozen parameters and persistent buffers, written by rank 0)
and ``zero_rank_XXXXX.safetensors`` per rank (the rank's flat master partition and optimizer
moments). Rebuilding needs no process group and no model: the layout in ``meta.json`` says
where every element of every rank's partition belongs.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch
from polyaccel.errors import PolyaccelError
from safetensors import safe_open

from .partition import FlatLayout, ShardLayout

META = "meta.json"
MODEL_STATES = "model_states.safetensors"
LATEST = "latest"
FORMAT = "polyaccel-zero"
#: above this many bytes of partitions the command line shows a progress bar
PROGRESS_BYTES = 256 * 2**20


def rank_file(rank: int) -> str:
    return f"zero_rank_{rank:05d}.safetensors"


def resolve_tag(ckpt_dir, tag: str | None = None) -> Path:
    """The folder of ``tag`` (or of the tag named in ``latest``) inside ``ckpt_dir``."""
    root = Path(ckpt_dir)
    if tag is None:
        latest = root / LATEST
        if not latest.is_file():
            raise PolyaccelError(f"no ZeRO checkpoint in {str(root)!r}: the file {LATEST!r} is missing "
                                 "(pass the checkpoint directory, or a tag)")
        tag = latest.read_text().strip()
    folder = root / tag
    if not (folder / META).is_file():
        old = root / f".{tag}.old"
        if (old / META).is_file():  # a re-save of this tag was interrupted between its two renames
            return old
        raise PolyaccelError(f"checkpoint tag {tag!r} in {str(root)!r} is incomplete or missing ({META} not found)")
    return folder


def read_meta(folder: Path) -> dict:
    meta = json.loads((folder / META).read_text())
    if meta.get("format") != FORMAT:
        raise PolyaccelError(f"{folder} is not a polyaccel ZeRO checkpoint (format {meta.get('format')!r})")
    return meta


def layout_from_meta(meta: dict):
    lay = meta["layout"]
    shapes = [tuple(s) for s in lay["shapes"]]
    if meta["zero_stage"] in (1, 2):
        return FlatLayout(lay["names"], shapes, meta["world_size"], lay["bucket_chunk"] * meta["world_size"])
    return ShardLayout(lay["names"], shapes, meta["world_size"])


def read_partitions(folder: Path, meta: dict, key: str) -> list[torch.Tensor]:
    parts = []
    for r in range(meta["world_size"]):
        path = folder / rank_file(r)
        if not path.is_file():
            raise PolyaccelError(f"checkpoint {folder} lacks the shard of rank {r} ({path.name})")
        with safe_open(str(path), framework="pt") as f:
            parts.append(f.get_tensor(key))
    return parts


def full_tensors(folder: Path, meta: dict, key: str) -> dict[str, torch.Tensor]:
    """Full per-parameter tensors of one flat quantity (``master``, ``exp_avg``...) from every rank."""
    layout = layout_from_meta(meta)
    parts = read_partitions(folder, meta, key)
    if isinstance(layout, FlatLayout):
        return layout.unflatten(layout.full_from_partitions(parts))
    return layout.unflatten_partitions(parts)


def group_id(key) -> str:
    """Name of a parameter group in rank files: its layout key, e.g. ``data|-|tensor``."""
    return "|".join(x or "-" for x in key)


def rank_groups(folder: Path, rank: int) -> list[dict]:
    """The groups a rank saved (version-2 checkpoints): key, names, local shapes, partition ranks, splits."""
    path = folder / rank_file(rank)
    if not path.is_file():
        raise PolyaccelError(f"checkpoint {folder} lacks the shard of rank {rank} ({path.name})")
    with safe_open(str(path), framework="pt") as f:
        return json.loads(f.metadata()["groups"])


def _group_layout(meta: dict, group: dict):
    shapes = [tuple(x) for x in group["shapes"]]
    world = len(group["ranks"])
    if meta["zero_stage"] in (1, 2):
        return FlatLayout(group["names"], shapes, world, group["bucket_chunk"] * world)
    return ShardLayout(group["names"], shapes, world)


def _assemble(name: str, pieces: dict[int, torch.Tensor], split: dict, folder: Path) -> torch.Tensor:
    from polyaccel.parallel import Split

    sp = Split(split["dim"], split["axis"], tuple(tuple(x) for x in split["sections"]), 0)
    missing = sorted(set(range(sp.degree)) - set(pieces))
    if missing:
        raise PolyaccelError(f"checkpoint {folder} lacks the {sp.dim} piece(s) {missing} of {name!r}")
    return sp.assemble([pieces[r] for r in range(sp.degree)])


def full_tensors_v2(folder: Path, meta: dict, key: str, groups: dict[int, list[dict]] | None = None,
                    tick=None) -> dict[str, torch.Tensor]:
    """Full, unsplit tensors of ``key`` from a version-2 checkpoint: each partition group's partitions give
    this coordinate's local tensors; pieces split over tensor or expert ranks are put back together."""
    groups = groups or {r: rank_groups(folder, r) for r in range(meta["world_size"])}
    whole: dict[str, torch.Tensor] = {}
    pieces: dict[str, dict[int, torch.Tensor]] = {}
    splits: dict[str, dict] = {}
    done: set[tuple] = set()
    handles = {}
    try:
        for rank in range(meta["world_size"]):
            for group in groups[rank]:
                instance = (group_id(group["key"]), tuple(group["ranks"]))
                if instance in done:
                    continue
                done.add(instance)
                parts = []
                for r in group["ranks"]:
                    if r not in handles:
                        handles[r] = safe_open(str(folder / rank_file(r)), framework="pt").__enter__()
                    parts.append(handles[r].get_tensor(f"{instance[0]}/{key}"))
                layout = _group_layout(meta, group)
                if isinstance(layout, FlatLayout):
                    local = layout.unflatten(layout.full_from_partitions(parts))
                else:
                    local = layout.unflatten_partitions(parts)
                for name, t in local.items():
                    split = group["splits"].get(name)
                    if split is None:
                        whole.setdefault(name, t)
                    else:
                        splits[name] = split
                        pieces.setdefault(name, {})[split["rank"]] = t
                if tick is not None:
                    tick()
    finally:
        for h in handles.values():
            h.__exit__(None, None, None)
    for name, by_rank in pieces.items():
        whole[name] = _assemble(name, by_rank, splits[name], folder)
    return whole


def full_tensors_any(folder: Path, meta: dict, key: str) -> dict[str, torch.Tensor]:
    if meta.get("version", 1) >= 2:
        return full_tensors_v2(folder, meta, key)
    return full_tensors(folder, meta, key)


def read_model_states(folder: Path) -> dict[str, torch.Tensor]:
    path = folder / MODEL_STATES
    out = {}
    with safe_open(str(path), framework="pt") as f:
        for k in f.keys():  # noqa: SIM118 - safe_open has no __iter__
            out[k] = f.get_tensor(k)
    return out


def consolidate(ckpt_dir, tag: str | None = None, progress: bool | None = None) -> dict[str, torch.Tensor]:
    """The full state dict (master precision: fp32, or fp64 for a float64 model) of a checkpoint.

    Keys are those of the model's ``state_dict()``: trainable parameters from the fp32 masters,
    frozen parameters and persistent buffers as saved, tied names repeated.
    """
    folder = resolve_tag(ckpt_dir, tag)
    meta = read_meta(folder)
    master_dtype = getattr(torch, meta["master_dtype"])
    nbytes = sum(os.path.getsize(folder / rank_file(r)) for r in range(meta["world_size"]))
    show = progress if progress is not None else nbytes > PROGRESS_BYTES
    if meta.get("version", 1) >= 2:
        groups = {r: rank_groups(folder, r) for r in range(meta["world_size"])}
        if show:
            from rich.progress import Progress

            total = len({(group_id(g["key"]), tuple(g["ranks"])) for gs in groups.values() for g in gs})
            with Progress() as bar:
                task = bar.add_task(f"assembling {total} partition groups", total=total)
                trained = full_tensors_v2(folder, meta, "master", groups, tick=lambda: bar.advance(task))
        else:
            trained = full_tensors_v2(folder, meta, "master", groups)
        return _state_dict(folder, meta, trained, master_dtype)
    layout = layout_from_meta(meta)
    parts = []
    if show:
        from rich.progress import Progress

        with Progress() as bar:
            task = bar.add_task(f"reading {meta['world_size']} shards", total=meta["world_size"])
            for r in range(meta["world_size"]):
                with safe_open(str(folder / rank_file(r)), framework="pt") as f:
                    parts.append(f.get_tensor("master"))
                bar.advance(task)
    else:
        parts = read_partitions(folder, meta, "master")
    if isinstance(layout, FlatLayout):
        trained = layout.unflatten(layout.full_from_partitions(parts))
    else:
        trained = layout.unflatten_partitions(parts)
    return _state_dict(folder, meta, trained, master_dtype)


def _state_dict(folder: Path, meta: dict, trained: dict[str, torch.Tensor], master_dtype) -> dict[str, torch.Tensor]:
    states = read_model_states(folder)
    out: dict[str, torch.Tensor] = {}
    for name in meta["state_dict_keys"]:
        canonical = meta["aliases"].get(name, name)
        if canonical in trained:
            out[name] = trained[canonical].clone() if name != canonical else trained[canonical]
        elif canonical in states:
            t = states[canonical]
            if canonical in meta["frozen"] and t.is_floating_point():
                t = t.to(master_dtype)
            out[name] = t.clone() if name != canonical else t
        else:
            raise PolyaccelError(f"checkpoint {folder} has no tensor for {name!r}")
    return out


def save_state_dict(state: dict[str, torch.Tensor], out_path) -> Path:
    """Write ``state`` as one safetensors file, atomically (temporary name, fsync, rename)."""
    from safetensors.torch import save_file

    out = Path(out_path)
    if out.is_dir():
        out = out / "model.safetensors"
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}")
    save_file({k: v.contiguous() for k, v in state.items()}, str(tmp), metadata={"format": "pt"})
    with open(tmp, "rb") as f:
        os.fsync(f.fileno())
    os.replace(tmp, out)
    return out
