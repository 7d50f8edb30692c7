"""The trainers' own checkpoint files: listed with their checksums at save, checked before a resume reads them.

A checkpoint written by :class:`~polyaccel.integrations.transformers.PolyaccelTrainer` or
:class:`~polyaccel.integrations.lightning.PolyaccelStrategy` is a folder holding the engine's checkpoint
(which checks its own files) next to files of the trainer: Hugging Face's ``trainer_state.json``,
``scheduler.pt``, ``rng_state*.pth``, ``model.safetensors`` ...; Lightning's ``lightning.pt``. The trainer
writes :data:`MANIFEST` last, naming each of its files with its size and SHA-256; a resume checks every
file it lists before anything is read, so a truncated, altered or missing file is refused naming the file,
in one line, instead of failing deep inside an unpickler or ``json.loads`` (or, worse, loading).

The manifest covers itself: its first key, ``"checksum"``, is the SHA-256 of the file's exact text with
those 64 hex digits written as zeros.

A checksum is not a signature: whoever can write a checkpoint can write a matching manifest. What keeps a
crafted checkpoint from running code is that no file is unpickled beyond torch's ``weights_only`` loader.
"""

from __future__ import annotations

from pathlib import Path

from ..errors import CheckpointError
from ..safe_files import check_files, read_record, record_files, write_checked_json

MANIFEST = "polyaccel-files.json"
FORMAT = "polyaccel-trainer-files"


def write_manifest(folder, names, trainer: str) -> Path:
    """Record ``names`` (files directly in ``folder``) with their sizes and checksums; written last, atomically."""
    folder = Path(folder)
    record = {"format": FORMAT, "version": 1, "trainer": trainer, "files": record_files(folder, names)}
    return write_checked_json(folder / MANIFEST, record)


def _read_manifest(folder: Path, fix: str) -> dict:
    path = folder / MANIFEST
    if not path.is_file():
        raise CheckpointError(f"{path}: missing, so the checkpoint's files cannot be checked (deleted, or written by "
                              f"an older polyaccel); {fix}", path)
    meta = read_record(path, FORMAT, fix)
    if not isinstance(meta.get("files"), dict):
        raise CheckpointError(f"{path}: not a {FORMAT} manifest (it lists no files); {fix}", path)
    return meta


def load_refusal(exc: BaseException) -> str:
    """One line saying why ``torch.load(weights_only=True)`` refused a file (torch's own text spans many lines
    and suggests ``weights_only=False``, which is what must not happen to a file nobody vouches for)."""
    import pickle
    import re

    text = str(exc)
    if isinstance(exc, pickle.UnpicklingError) or "Weights only load failed" in text:
        found = re.search(r"Unsupported (global|operand):? (?:GLOBAL )?(\S+)", re.sub(r"\x1b\[[0-9;]*m", "", text))
        if found and found.group(1) == "global":
            return (f"torch's weights_only loader refused it: unsupported global {found.group(2)}; it may be crafted "
                    "to run code when loaded")
        return "torch's weights_only loader refused it: not a torch file of plain values, or damaged"
    first = text.strip().splitlines()[0] if text.strip() else "no message"
    return f"{type(exc).__name__}: {first}"


def verify(folder, fix: str) -> dict[str, dict]:
    """Check every file the manifest in ``folder`` lists (present, same size, same SHA-256); returns the list.
    The first problem raises :class:`CheckpointError` naming the file, ending with ``fix``."""
    files = _read_manifest(Path(folder), fix)["files"]
    check_files(folder, files, fix, listed_by=f"the checkpoint's {MANIFEST}")
    return files


__all__ = ["FORMAT", "MANIFEST", "load_refusal", "verify", "write_manifest"]
