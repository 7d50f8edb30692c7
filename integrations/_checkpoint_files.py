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

import hashlib
import json
import os
from pathlib import Path

from ..errors import CheckpointError

MANIFEST = "polyaccel-files.json"
FORMAT = "polyaccel-trainer-files"
_ZEROS = "0" * 64
_PREFIX = '{\n "checksum": "'


def file_sha256(path) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def _fsync(path) -> None:
    fd = os.open(str(path), os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_atomic(path, data: bytes) -> None:
    """``data`` into ``path`` under a temporary name, fsynced, then renamed: a crash leaves the old file or none."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    tmp.write_bytes(data)
    _fsync(tmp)
    os.replace(tmp, path)


def write_manifest(folder, names, trainer: str) -> Path:
    """Record ``names`` (files directly in ``folder``) with their sizes and checksums; written last, atomically."""
    folder = Path(folder)
    files = {}
    for name in sorted(names):
        p = folder / name
        files[name] = {"bytes": p.stat().st_size, "sha256": file_sha256(p)}
    text = json.dumps({"checksum": _ZEROS, "format": FORMAT, "version": 1, "trainer": trainer, "files": files},
                      indent=1)
    text = text.replace(_ZEROS, hashlib.sha256(text.encode()).hexdigest(), 1)
    write_atomic(folder / MANIFEST, text.encode())
    return folder / MANIFEST


def _read_manifest(folder: Path, fix: str) -> dict:
    path = folder / MANIFEST
    if not path.is_file():
        raise CheckpointError(f"{path}: missing, so the checkpoint's files cannot be checked (deleted, or written by "
                              f"an older polyaccel); {fix}", path)
    raw = path.read_bytes()
    start = len(_PREFIX)
    stored = raw[start:start + 64].decode("ascii", "replace")
    expect = hashlib.sha256(raw[:start] + _ZEROS.encode() + raw[start + 64:]).hexdigest()
    if not raw.startswith(_PREFIX.encode()) or stored != expect:
        raise CheckpointError(f"{path}: damaged (its checksum does not match its {len(raw)} bytes); {fix}", path)
    meta = json.loads(raw)  # cannot fail: the checksum covers the text this module wrote
    if meta.get("format") != FORMAT or not isinstance(meta.get("files"), dict):
        raise CheckpointError(f"{path}: not a {FORMAT} manifest; {fix}", path)
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
    folder = Path(folder)
    files = _read_manifest(folder, fix)["files"]
    for name, rec in files.items():
        p = folder / name
        if not p.is_file():
            raise CheckpointError(f"{p}: missing (the checkpoint's {MANIFEST} lists it); {fix}", p)
        size = p.stat().st_size
        if size != rec["bytes"]:
            raise CheckpointError(f"{p}: {size} bytes, {rec['bytes']} when saved: truncated or altered; {fix}", p)
        if file_sha256(p) != rec["sha256"]:
            raise CheckpointError(f"{p}: damaged (its SHA-256 differs from the one recorded at save); {fix}", p)
    return files


__all__ = ["FORMAT", "MANIFEST", "file_sha256", "load_refusal", "verify", "write_atomic", "write_manifest"]
