"""Does a checkpoint fit the model it is loaded into? Names, full shapes, kinds and dtypes, before any change.

Loading cuts full tensors into the model's partitions by element counts; without this check the
checkpoint of ``Linear(4, 8)`` would load into ``Linear(8, 4)`` (the same 32 elements, transposed), and
parameters the model lacks would be dropped. Both sides are described the same way, one record per
tensor of the model's state (tied names once, under their first name):

- ``kind``: ``trainable`` (in the optimizer's partitions), ``frozen`` or ``buffer`` (persistent);
- ``shape``: the full shape, a parameter split over tensor or expert ranks put back together;
- ``dtype``: for frozen parameters and buffers, whose saved values are loaded as they are (a trainable
  parameter loads from its master copy, whose precision ``meta.json`` records).

The checkpoint's record comes from what loading rebuilds the tensors from, headers only (no tensor is
read): the partition layout in ``meta.json`` (version 1) or the group records of each rank file (version
2), and the header of ``model_states.safetensors``; ``meta.json``'s ``params`` (the full shapes, written
at save) must agree with them. Dtypes must match exactly when the engine computes in the
dtype the checkpoint was saved in (a different dtype then means a different model); across a change of
training precision (fp32 -> bf16) only the kind of number must (floating, integer, bool).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from polyaccel.errors import CheckpointError
from polyaccel.parallel import get_layout

from .consolidate import MODEL_STATES, Shard, rank_groups
from .integrity import _DTYPES

_DTYPE_OF_CODE = {code: str(dt).removeprefix("torch.") for dt, code in _DTYPES.items()}
#: mismatches named in one error, at most
_SHOWN = 4


@dataclass(frozen=True)
class Entry:
    kind: str  # "trainable", "frozen" or "buffer"
    shape: tuple[int, ...]
    dtype: str | None  # frozen parameters and buffers only


def _full_shape(local: tuple[int, ...], split) -> tuple[int, ...]:
    if split is None:
        return tuple(local)
    out = list(local)
    out[split.axis] = split.full_length
    return tuple(out)


def engine_record(engine) -> dict[str, Entry]:
    """The model's record: what a checkpoint must hold to load into ``engine``."""
    out: dict[str, Entry] = {}
    for g in engine.groups:
        lay = g.partitioner.layout
        shapes = dict(zip(lay.names, lay.shapes, strict=True))
        for name, p in g.entries:
            out[name] = Entry("trainable", _full_shape(shapes[name], get_layout(p).split), None)
    infos = getattr(engine.groups[0].partitioner, "infos", {}) if engine.groups else {}
    for name, p in engine.frozen:
        info = infos.get(id(p))
        shape = info.shape if info is not None else tuple(p.shape)
        out[name] = Entry("frozen", tuple(shape), str(p.dtype).removeprefix("torch."))
    persistent = set(engine.module.state_dict().keys())
    for name, buf in engine.module.named_buffers():
        if name in persistent and buf is not None:
            out[name] = Entry("buffer", tuple(buf.shape), str(buf.dtype).removeprefix("torch."))
    return out


def trainable_shapes(engine) -> dict[str, list[int]]:
    """Full shapes of the trainable parameters, as ``meta.json`` records them (``"params"``)."""
    return {n: list(e.shape) for n, e in engine_record(engine).items() if e.kind == "trainable"}


def _v2_trainable(folder: Path, meta: dict) -> dict[str, tuple[int, ...]]:
    from polyaccel.parallel import Split

    out: dict[str, tuple[int, ...]] = {}
    for r in range(meta["world_size"]):
        for group in rank_groups(folder, r):
            for name, shape in zip(group["names"], group["shapes"], strict=True):
                sp = group["splits"].get(name)
                split = None if sp is None else Split(sp["dim"], sp["axis"], tuple(tuple(x) for x in sp["sections"]),
                                                      sp["rank"])
                out.setdefault(name, _full_shape(tuple(shape), split))
    return out


def checkpoint_record(folder: Path, meta: dict) -> dict[str, Entry]:
    """The checkpoint's record, from ``meta.json`` and the files' headers."""
    if meta.get("version", 1) >= 2:  # what loading rebuilds the tensors from: the rank files' group records
        trainable = _v2_trainable(folder, meta)
    else:  # ... or meta.json's partition layout
        lay = meta["layout"]
        trainable = {n: tuple(s) for n, s in zip(lay["names"], lay["shapes"], strict=True)}
    recorded = meta.get("params")
    if isinstance(recorded, dict) and {n: tuple(s) for n, s in recorded.items()} != trainable:
        raise CheckpointError(f"{folder / 'meta.json'}: its 'params' record does not match the partition layout the "
                              "rank files were saved in; the files come from different saves; restore the checkpoint "
                              "folder from a good copy, or load another tag", folder / "meta.json")
    out = {n: Entry("trainable", s, None) for n, s in trainable.items()}
    frozen = set(meta.get("frozen", ()))
    with Shard(folder / MODEL_STATES) as f:
        for name, (shape, code) in f.header().items():
            out[name] = Entry("frozen" if name in frozen else "buffer", shape, _DTYPE_OF_CODE.get(code, code))
    return out


def _kind_of_number(dtype: str | None) -> str:
    if dtype is None:
        return "?"
    if dtype == "bool":
        return "bool"
    return "floating" if dtype.startswith(("float", "bfloat")) else "integer"


def mismatches(saved: dict[str, Entry], model: dict[str, Entry], same_precision: bool) -> list[str]:
    """Every way ``saved`` does not fit ``model``, one phrase each (empty: it fits)."""
    out = []
    missing = [n for n in model if n not in saved]
    unexpected = [n for n in saved if n not in model]
    if missing:
        out.append(f"the model's {_names(missing)} {'is' if len(missing) == 1 else 'are'} not in the checkpoint")
    if unexpected:
        out.append(f"the checkpoint's {_names(unexpected)} {'is' if len(unexpected) == 1 else 'are'} not in the "
                   "model")
    for name, want in model.items():
        got = saved.get(name)
        if got is None:
            continue
        if got.shape != want.shape:
            out.append(f"{name!r} has shape {list(got.shape)} in the checkpoint, {list(want.shape)} in the model")
        elif got.kind != want.kind:
            out.append(f"{name!r} is {got.kind} in the checkpoint, {want.kind} in the model")
        elif want.dtype is not None and got.dtype != want.dtype and (
                same_precision or _kind_of_number(got.dtype) != _kind_of_number(want.dtype)):
            out.append(f"{name!r} is {got.dtype} in the checkpoint, {want.dtype} in the model")
    return out


def _names(names: list[str]) -> str:
    shown = ", ".join(repr(n) for n in names[:_SHOWN])
    return shown + (f" and {len(names) - _SHOWN} more" if len(names) > _SHOWN else "")


def check_fits(engine, folder: Path, meta: dict) -> None:
    """Raise :class:`CheckpointError` naming the first differences when the checkpoint in ``folder`` does not fit
    ``engine``'s model (nothing is changed)."""
    saved = checkpoint_record(folder, meta)
    same = meta.get("compute_dtype") == str(engine.compute_dtype).removeprefix("torch.")
    problems = mismatches(saved, engine_record(engine), same)
    if problems:
        more = f" (and {len(problems) - _SHOWN} more difference(s))" if len(problems) > _SHOWN else ""
        raise CheckpointError(f"checkpoint {folder} does not fit this model: {'; '.join(problems[:_SHOWN])}{more}; "
                              "load it into the model it was saved from (same architecture and sizes), or "
                              "convert it with `polyaccel zero-to-fp32` and load what fits by hand; nothing was "
                              "loaded", folder)


__all__ = ["Entry", "check_fits", "checkpoint_record", "engine_record", "mismatches", "trainable_shapes"]
