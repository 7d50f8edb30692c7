"""Read a ZeRO checkpoint offline and rebuild full tensors (the ``zero-to-fp32`` conversion).

A checkpoint directory holds ``latest`` (the newest complete tag) and one folder per tag:
``meta.json`` (stage, world size, partition layout, counters, client state),
``model_states.safetensors`` (frozen parameters and persistent buffers, written by rank 0)
and ``zero_rank_XXXXX.safetensors`` per rank (the rank's flat master partition and optimizer
moments). Rebuilding needs no process group and no model: the layout in ``meta.json`` says
where every element of every rank's partition belongs. ``meta.json`` also records every other
file's size and checksum and carries its own (:mod:`polyaccel.safe_files`); readers check them before
trusting a byte, and every failure names the file.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch
from polyaccel.errors import CheckpointError, InvalidArgument, PolyaccelError
from polyaccel.safe_files import ALGORITHM, file_digest, read_checked_json, write_safetensors_file
from safetensors import safe_open

from .partition import FlatLayout, ShardLayout

META = "meta.json"
MODEL_STATES = "model_states.safetensors"
LATEST = "latest"
FORMAT = "polyaccel-zero"
#: above this many bytes of partitions the command line shows a progress bar
PROGRESS_BYTES = 256 * 2**20


#: what to do about a damaged or missing file, said at the end of every such error
FIX = "restore the checkpoint folder from a good copy, or load another tag"


#: tag names a checkpoint folder can never take: the files beside the tags
RESERVED_TAGS = (LATEST,)
#: the longest tag, in UTF-8 bytes (a file name is at most 255; the staging folder adds ``.<tag>.partial``)
MAX_TAG_BYTES = 200


def tag_problem(tag) -> str | None:
    """Why ``tag`` cannot name a checkpoint folder, or None: a tag is a plain folder name of its own."""
    if isinstance(tag, bool) or not isinstance(tag, (str, int)):
        return f"is a {type(tag).__name__}, not a string"
    tag = str(tag)
    if not tag.strip():
        return "is empty"
    if "\0" in tag:
        return "holds a NUL byte"
    if any(ord(c) < 32 or ord(c) == 127 for c in tag):
        return "holds a control character (a newline, a tab...)"
    if "/" in tag or "\\" in tag or (os.altsep and os.altsep in tag):
        return "holds a path separator ('/' or '\\'): a tag names one folder inside the checkpoint directory"
    if tag != tag.strip():
        return "starts or ends with whitespace (the 'latest' file could not give it back)"
    if tag.startswith("."):
        return "starts with '.' (hidden names are the staging and backup folders')"
    if tag.casefold() in {t.casefold() for t in RESERVED_TAGS}:
        return f"is reserved: {LATEST!r} is the file naming the newest checkpoint"
    if tag.endswith(".json"):
        return "ends with '.json' (the names of the files kept beside the tags)"
    if len(tag.encode("utf-8", "surrogatepass")) > MAX_TAG_BYTES:
        return f"is longer than {MAX_TAG_BYTES} bytes"
    return None


def check_tag(tag, what: str = "checkpoint tag") -> str:
    """``tag`` as a string when it can name a checkpoint folder; else :class:`InvalidArgument` saying why."""
    problem = tag_problem(tag)
    if problem is not None:
        raise InvalidArgument(f"{what} {tag!r} {problem}; pass a plain folder name such as 'global_step100'")
    return str(tag)


def rank_file(rank: int) -> str:
    return f"zero_rank_{rank:05d}.safetensors"


def complete_tags(root: Path) -> list[str]:
    """The tags in ``root`` that have a ``meta.json`` (sorted; staging and backup folders left out)."""
    if not root.is_dir():
        return []
    return sorted(p.name for p in root.iterdir() if not p.name.startswith(".") and (p / META).is_file())


def _tags_hint(root: Path) -> str:
    tags = complete_tags(root)
    return f"complete checkpoints here: {', '.join(tags)}" if tags else "no complete checkpoint is here"


def read_latest(root: Path) -> str:
    """The tag named by ``root/latest``; a missing, empty or malformed file raises :class:`CheckpointError`."""
    latest = root / LATEST
    if not latest.is_file():
        raise CheckpointError(f"no ZeRO checkpoint in {str(root)!r}: the file {LATEST!r} is missing "
                              f"(pass the checkpoint directory, or a tag; {_tags_hint(root)})", latest)
    try:
        tag = latest.read_bytes().decode("utf-8").strip()
    except (OSError, UnicodeDecodeError) as exc:
        raise CheckpointError(f"{latest}: cannot be read as a tag ({exc}); write the tag to load into it "
                              f"({_tags_hint(root)}) or pass a tag", latest) from None
    if not tag or "/" in tag or "\n" in tag or tag.startswith("."):
        what = "is empty" if not tag else f"holds {tag[:60]!r}, not a checkpoint tag"
        raise CheckpointError(f"{latest} {what}; write the tag to load into it ({_tags_hint(root)}) "
                              "or pass a tag", latest)
    return tag


def resolve_tag(ckpt_dir, tag: str | None = None) -> Path:
    """The folder of ``tag`` (or of the tag named in ``latest``) inside ``ckpt_dir``."""
    root = Path(ckpt_dir)
    if not root.is_dir():
        raise CheckpointError(f"{str(root)!r} is not a directory; pass the directory given to save_checkpoint", root)
    named_by = "" if tag is not None else f" (named by {root / LATEST})"
    if tag is None:
        tag = read_latest(root)
    else:
        tag = check_tag(tag)
    folder = root / tag
    if not (folder / META).is_file():
        old = root / f".{tag}.old"
        if (old / META).is_file():  # a re-save of this tag was interrupted between its two renames
            return old
        if folder.is_dir():
            raise CheckpointError(f"{folder / META} is missing, so checkpoint {tag!r}{named_by} is incomplete; "
                                  f"{FIX} ({_tags_hint(root)})", folder / META)
        raise CheckpointError(f"checkpoint {str(folder)!r}{named_by} does not exist; {_tags_hint(root)}", folder)
    return folder


def read_meta(folder: Path, verify: bool = True) -> dict:
    """``meta.json`` of a checkpoint folder, its checksum checked (a file without one is refused when ``verify``)."""
    path = folder / META
    meta, checked = read_checked_json(path, FIX)
    if meta.get("format") != FORMAT:
        raise CheckpointError(f"{folder} is not a polyaccel ZeRO checkpoint (format {meta.get('format')!r} "
                              f"in {path})", path)
    if verify and not (checked and "files" in meta):
        raise CheckpointError(f"{path}: this checkpoint was saved without checksums (by an older polyaccel), so it "
                              "cannot be verified; load it with the config key checkpoint.verify = false "
                              "(zero-to-fp32 --no-verify) and save it again", path)
    return meta


def saved_files(meta: dict) -> list[str]:
    """Every file the checkpoint's ``meta.json`` says was written besides itself."""
    ranks = {rank_file(r) for r in range(meta["world_size"])}
    return sorted(set(meta.get("files", ())) | ranks | {MODEL_STATES})


def check_files(folder: Path, meta: dict) -> None:
    """Every saved file is there with the size recorded at save (cheap: one ``stat`` each)."""
    names = saved_files(meta)
    missing = [n for n in names if not (folder / n).is_file()]
    if missing:
        present = sorted(p.name for p in folder.iterdir() if p.is_file())
        ranks = [n for n in names if n.startswith("zero_rank_")]
        others = f" (and {', '.join(missing[1:])})" if len(missing) > 1 else ""
        raise CheckpointError(
            f"{folder / missing[0]} is missing{others}: checkpoint {folder.name!r} was saved by "
            f"{meta['world_size']} rank(s) ({len(ranks)} rank files {_span(ranks)}, plus {MODEL_STATES}); the folder "
            f"holds {', '.join(present) or 'no file'}; {FIX}", folder / missing[0])
    for name, rec in meta.get("files", {}).items():
        path = folder / name
        size = path.stat().st_size
        if size != rec["bytes"]:
            how = "truncated" if size < rec["bytes"] else "longer than written"
            raise CheckpointError(f"{path}: {size} bytes, but {rec['bytes']} were saved: the file is {how}; {FIX}",
                                  path)


def _span(names: list[str]) -> str:
    return names[0] if len(names) == 1 else f"{names[0]} .. {names[-1]}" if names else "none"


def verify_files(folder: Path, meta: dict, names=None) -> int:
    """Check the checksums of ``names`` (default: every saved file); returns the bytes read."""
    integrity = meta.get("integrity", {})
    if integrity.get("algorithm") != ALGORITHM:
        raise CheckpointError(f"{folder / META}: checksum algorithm {integrity.get('algorithm')!r} is not "
                              f"{ALGORITHM!r}; load it with checkpoint.verify = false", folder / META)
    total = 0
    for name in (names if names is not None else saved_files(meta)):
        rec, path = meta["files"][name], folder / name
        size, digest = file_digest(path, integrity["chunk_bytes"])
        if size != rec["bytes"] or digest != rec["sha256"]:
            raise CheckpointError(f"{path}: checksum mismatch, the file is damaged ({size} bytes); {FIX}", path)
        total += size
    return total


class Shard:
    """A safetensors file of a checkpoint, opened so that any failure to read it names the file."""

    def __init__(self, path: Path):
        self.path = path
        try:
            self._ctx = safe_open(str(path), framework="pt")
            self._f = self._ctx.__enter__()
        except FileNotFoundError:
            raise CheckpointError(f"{path}: the file is missing; {FIX}", path) from None
        except Exception as exc:  # noqa: BLE001 - SafetensorError, OSError: the file is unreadable
            raise self._damaged(exc) from None

    def _damaged(self, exc: Exception) -> CheckpointError:
        return CheckpointError(f"{self.path}: not a readable safetensors file ({type(exc).__name__}: "
                               f"{str(exc)[:200]}); it is damaged or truncated; {FIX}", self.path)

    def get_tensor(self, key: str) -> torch.Tensor:
        try:
            names = set(self._f.keys())
            if key not in names:
                raise CheckpointError(f"{self.path}: holds no tensor {key!r} (it has {sorted(names)[:6]}); "
                                      f"it does not belong to this checkpoint; {FIX}", self.path)
            return self._f.get_tensor(key)
        except CheckpointError:
            raise
        except Exception as exc:  # noqa: BLE001
            raise self._damaged(exc) from None

    def keys(self) -> list[str]:
        return list(self._f.keys())

    def header(self) -> dict[str, tuple[tuple[int, ...], str]]:
        """``{name: (shape, safetensors dtype code)}`` of every tensor, from the header alone."""
        try:
            out = {}
            for k in self._f.keys():  # noqa: SIM118 - a safe_open handle has no __iter__
                sl = self._f.get_slice(k)
                out[k] = (tuple(sl.get_shape()), str(sl.get_dtype()))
            return out
        except Exception as exc:  # noqa: BLE001
            raise self._damaged(exc) from None

    def metadata(self) -> dict:
        return self._f.metadata() or {}

    def close(self) -> None:
        self._ctx.__exit__(None, None, None)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def _rebuild(layout, parts: list[torch.Tensor]) -> dict[str, torch.Tensor]:
    if isinstance(layout, FlatLayout):
        return layout.unflatten(layout.full_from_partitions(parts))
    return layout.unflatten_partitions(parts)


def _fit(folder: Path, meta: dict, layout, parts: list[torch.Tensor]) -> dict[str, torch.Tensor]:
    """The full tensors of ``parts``; shape errors become the checkpoint's own: the shards do not fit ``meta.json``."""
    try:
        return _rebuild(layout, parts)
    except (RuntimeError, ValueError, IndexError) as exc:
        ranks = [n for n in saved_files(meta) if n.startswith("zero_rank_")]
        raise CheckpointError(
            f"checkpoint {folder}: the rank files do not fit the layout in {META} (saved by {meta['world_size']} "
            f"rank(s), files {_span(ranks)}): {str(exc)[:160]}; the files come from different saves; {FIX}",
            folder) from None


def layout_from_meta(meta: dict):
    lay = meta["layout"]
    shapes = [tuple(s) for s in lay["shapes"]]
    if meta["zero_stage"] in (1, 2):
        return FlatLayout(lay["names"], shapes, meta["world_size"], lay["bucket_chunk"] * meta["world_size"])
    return ShardLayout(lay["names"], shapes, meta["world_size"])


def read_partitions(folder: Path, meta: dict, key: str) -> list[torch.Tensor]:
    parts = []
    for r in range(meta["world_size"]):
        with Shard(folder / rank_file(r)) as f:
            parts.append(f.get_tensor(key))
    return parts


def full_tensors(folder: Path, meta: dict, key: str) -> dict[str, torch.Tensor]:
    """Full per-parameter tensors of one flat quantity (``master``, ``exp_avg``...) from every rank."""
    layout = layout_from_meta(meta)
    parts = read_partitions(folder, meta, key)
    return _fit(folder, meta, layout, parts)


def group_id(key) -> str:
    """Name of a parameter group in rank files: its layout key, e.g. ``data|-|tensor``."""
    return "|".join(x or "-" for x in key)


def rank_groups(folder: Path, rank: int) -> list[dict]:
    """The groups a rank saved (version-2 checkpoints): key, names, local shapes, partition ranks, splits."""
    path = folder / rank_file(rank)
    with Shard(path) as f:
        groups = f.metadata().get("groups")
    try:
        return json.loads(groups)
    except (TypeError, json.JSONDecodeError):
        raise CheckpointError(f"{path}: its header lacks a valid 'groups' record; it is damaged; {FIX}", path) from None


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
                        handles[r] = Shard(folder / rank_file(r))
                    parts.append(handles[r].get_tensor(f"{instance[0]}/{key}"))
                layout = _group_layout(meta, group)
                local = _fit(folder, meta, layout, parts)
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
            h.close()
    for name, by_rank in pieces.items():
        whole[name] = _assemble(name, by_rank, splits[name], folder)
    return whole


def full_tensors_any(folder: Path, meta: dict, key: str) -> dict[str, torch.Tensor]:
    if meta.get("version", 1) >= 2:
        return full_tensors_v2(folder, meta, key)
    return full_tensors(folder, meta, key)


def read_model_states(folder: Path) -> dict[str, torch.Tensor]:
    with Shard(folder / MODEL_STATES) as f:
        return {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118 - a Shard has no __iter__


def open_checkpoint(ckpt_dir, tag: str | None = None, verify: bool = True) -> tuple[Path, dict]:
    """(folder, meta) of a checkpoint whose files are all there at their saved sizes, and, when ``verify``,
    match their checksums; anything else raises :class:`CheckpointError` naming the file."""
    folder = resolve_tag(ckpt_dir, tag)
    meta = read_meta(folder, verify)
    check_files(folder, meta)
    if verify:
        verify_files(folder, meta)
    return folder, meta


def consolidate(ckpt_dir, tag: str | None = None, progress: bool | None = None,
                verify: bool = True) -> dict[str, torch.Tensor]:
    """The full state dict (master precision: fp32, or fp64 for a float64 model) of a checkpoint.

    Keys are those of the model's ``state_dict()``: trainable parameters from the fp32 masters,
    frozen parameters and persistent buffers as saved, tied names repeated. Every file is checked
    against its checksum first unless ``verify`` is false.
    """
    folder, meta = open_checkpoint(ckpt_dir, tag, verify)
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
                with Shard(folder / rank_file(r)) as f:
                    parts.append(f.get_tensor("master"))
                bar.advance(task)
    else:
        parts = read_partitions(folder, meta, "master")
    trained = _fit(folder, meta, layout, parts)
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


def output_file(out_path) -> Path:
    """The file ``out_path`` names: itself, or ``model.safetensors`` in it when it is a directory."""
    out = Path(out_path)
    return out / "model.safetensors" if out.is_dir() else out


def check_output_outside(out_path, ckpt_dir) -> Path:
    """The output file, when writing it cannot touch the checkpoint in ``ckpt_dir``: not inside that directory (by
    its real path, links followed) and not one of its files under another name (a hard link); else
    :class:`InvalidArgument` naming both."""
    out = output_file(out_path)
    root = Path(ckpt_dir).resolve()
    target = out.resolve()
    if target == root or root in target.parents:
        raise InvalidArgument(f"output {str(out_path)!r} is inside the checkpoint directory {str(ckpt_dir)!r} "
                              f"(it would write {target}); the conversion never writes into the checkpoint it "
                              "reads: pass a path outside it, e.g. model.safetensors")
    if target.exists() and root.is_dir():
        st = target.stat()
        for path in root.rglob("*"):
            try:
                other = path.stat()
            except OSError:
                continue
            if (other.st_ino, other.st_dev) == (st.st_ino, st.st_dev):
                raise InvalidArgument(f"output {str(out_path)!r} is the checkpoint's file {path} under another name "
                                      "(a hard link); writing it would replace that file: pass another path")
    return out


def save_state_dict(state: dict[str, torch.Tensor], out_path, checkpoint_dir=None) -> Path:
    """Write ``state`` as one safetensors file, atomically (temporary name, fsync, rename). With
    ``checkpoint_dir`` (the checkpoint ``state`` was read from), an output that would land in it is refused
    (:func:`check_output_outside`) before anything is written."""
    out = output_file(out_path) if checkpoint_dir is None else check_output_outside(out_path, checkpoint_dir)
    out.parent.mkdir(parents=True, exist_ok=True)
    return write_safetensors_file(out, state, {"format": "pt"})
