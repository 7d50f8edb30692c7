"""Check ZeRO checkpoints without loading them: ``polyaccel checkpoint verify DIR``.

Reads DIR's checkpoint (the tag named in ``latest``, --tag TAG, or --all tags) and checks that
``meta.json`` matches its own checksum, that every file it lists is there with the size recorded
at save, and that each file's bytes match their recorded checksum. JSON files next to the
checkpoints that carry a checksum (the train app's ``train-meta-<tag>.json``) are checked too, and
must come from the same save as the checkpoint (the same run id, or the record the save kept).
Prints one line per checkpoint; exits 1 at the first damaged or missing file, naming it.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

HELP = "check a ZeRO checkpoint's files against the sizes and checksums recorded at save"


def add_arguments(parser) -> None:
    sub = parser.add_subparsers(dest="action", metavar="ACTION", required=True)
    verify = sub.add_parser("verify", help="check every file of a checkpoint (exit 1 naming the first bad file)")
    verify.add_argument("checkpoint_dir", metavar="DIR", help="directory given to engine.save_checkpoint / --save")
    which = verify.add_mutually_exclusive_group()
    which.add_argument("--tag", default=None, help="checkpoint tag (default: the one in DIR/latest)")
    which.add_argument("--all", action="store_true", help="every complete checkpoint in DIR")


def _sidecars(root: Path, tag: str) -> list[Path]:
    """Checksummed JSON files in ``root`` that belong to ``tag`` (named ``<anything>-<tag>.json``)."""
    return sorted(p for p in root.glob(f"*-{tag}.json") if p.is_file() and not p.name.startswith("."))


def check_same_save(folder: Path, meta: dict, path: Path, record: dict) -> None:
    """``record`` (a JSON file saved beside the checkpoint ``folder``) comes from the same save as its ``meta.json``:
    the same run id when both carry one; else, where ``meta.json``'s client state holds a record with the same
    keys (what the train app passes), the same values. Raises :class:`CheckpointError` naming both files."""
    from polyaccel.errors import CheckpointError

    fix = "they come from two different runs; restore the pair from one run, or load another tag"
    ours, theirs = record.get("run_id"), meta.get("run_id")
    if ours is not None and theirs is not None:
        if ours != theirs:
            raise CheckpointError(f"{path} (run {ours}) and {folder / 'meta.json'} (run {theirs}) do not belong to "
                                  f"one save: {fix}", path)
        return
    for saved in (meta.get("client_state") or {}).values():
        if isinstance(saved, dict) and saved.keys() == record.keys() and saved != record:
            diff = sorted(k for k in record if record[k] != saved[k])
            shown = ", ".join(f"{k}: {record[k]!r} there, {saved[k]!r} in the checkpoint" for k in diff[:3])
            raise CheckpointError(f"{path} and {folder / 'meta.json'} do not describe one save ({shown}): {fix}", path)


def verify_checkpoint(root: Path, tag: str | None) -> str:
    """One line describing the verified checkpoint; raises :class:`CheckpointError` on the first bad file."""
    from polyaccel.safe_files import read_checked_json

    from .consolidate import open_checkpoint, saved_files

    t0 = time.perf_counter()
    folder, meta = open_checkpoint(root, tag, verify=True)
    nbytes = sum(rec["bytes"] for rec in meta["files"].values())
    extra = []
    for path in _sidecars(root, folder.name):
        record, checked = read_checked_json(path, "it no longer matches what was saved; restore it from a good copy")
        check_same_save(folder, meta, path, record)
        if checked:
            extra.append(path.name)
    files = len(saved_files(meta)) + 1 + len(extra)
    return (f"ok: {folder} ({meta['world_size']} rank(s), stage {meta['zero_stage']}, step {meta['global_steps']}): "
            f"{files} files, {nbytes / 2**20:.1f} MiB checked in {time.perf_counter() - t0:.2f} s"
            + (f" (with {', '.join(extra)})" if extra else ""))


def run(args) -> int:
    from polyaccel.errors import PolyaccelError

    from .consolidate import complete_tags

    root = Path(args.checkpoint_dir)
    try:
        tags = complete_tags(root) if args.all else [args.tag]
        if args.all and not tags:
            raise PolyaccelError(f"{str(root)!r} holds no complete checkpoint (no <tag>/meta.json)")
        for tag in tags:
            print(verify_checkpoint(root, tag))
    except (PolyaccelError, OSError) as exc:
        print(f"polyaccel checkpoint verify: {exc}", file=sys.stderr)
        return 1
    return 0
