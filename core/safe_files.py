"""Files that are never seen half-written, and never trusted when damaged.

Writing: :func:`write_atomic` has a function fill a temporary file in the target's folder, fsyncs it, renames
it over the target (``os.replace``) and fsyncs the folder where the OS allows it: a crash or an exception
leaves the old file or the new one, never a mix, and no temporary file. :func:`write_bytes`,
:func:`write_text`, :func:`write_json`, :func:`write_checked_json` and :func:`write_safetensors_file` are the
usual cases; a writer that takes a path (``torch.save``, a compiler's ``-o``) is handed the temporary path.
:func:`replace_folder` moves a finished folder into place. No other module renames or fsyncs files
(``tests/core/test_safe_files.py`` checks it).

Checking, with nothing ever unpickled:

- checksummed JSON: the object's first key is ``"checksum"``, the SHA-256 of the file's exact bytes with those
  64 hex digits written as zeros; every byte is covered, whitespace too (:func:`dumps_checked`,
  :func:`read_checked_json`, :func:`read_record` for one that must carry a checksum and a given ``format``);
- records of files, ``{name: {"bytes": size, "sha256": digest}}`` (:func:`record_files`, :func:`check_files`):
  a missing, truncated or altered file is refused naming it.

Digests: plain SHA-256 (:func:`file_sha256`), or :data:`ALGORITHM` for large files: the file is cut into
``CHUNK_BYTES`` pieces at fixed offsets (the last one shorter, none for an empty file), each piece hashed with
SHA-256, and the digest is the SHA-256 of the concatenated 32-byte piece digests in file order. The pieces are
independent, so a thread pool hashes them while the writer is still writing the next bytes
(:class:`ChunkHasher`), and :func:`file_digest` reads them back in parallel with ``os.pread``.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import os
import secrets
import shutil
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TypeVar

from .errors import CheckpointError

T = TypeVar("T")


# ----------------------------------------------------------------- atomic writes
def sync_file(f) -> None:
    """Flush the open file ``f`` and have the OS put it on disk."""
    f.flush()
    os.fsync(f.fileno())


def fsync_folder(folder) -> None:
    """Put ``folder``'s entries (a rename into it) on disk; a no-op where a folder cannot be opened or
    synced."""
    try:
        fd = os.open(str(folder), os.O_RDONLY)
    except OSError:  # Windows opens no folder; the rename is durable there without it
        return
    try:
        os.fsync(fd)
    except OSError as exc:
        if exc.errno not in (errno.EINVAL, errno.EBADF, errno.ENOTSUP):  # filesystems that sync no folder
            raise
    finally:
        os.close(fd)


def _reserve_temporary(path: Path) -> Path:
    """A new empty file beside ``path``, under a hidden name of this process, with the umask's mode."""
    while True:
        tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}-{secrets.token_hex(4)}")
        try:
            os.close(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666))
            return tmp
        except FileExistsError:
            continue


def write_atomic(path, write: Callable[[Path], T]) -> T:
    """``write(tmp)`` fills a temporary file beside ``path``; it is then fsynced and renamed to ``path``, and
    the folder fsynced. Returns what ``write`` returned. On any failure the temporary file is removed and
    ``path`` is as it was; an :class:`OSError` that names no file is raised again naming ``path``."""
    path = Path(path)
    tmp = _reserve_temporary(path)
    try:
        out = write(tmp)
        with open(tmp, "rb") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException as exc:
        with contextlib.suppress(OSError):
            tmp.unlink()
        if isinstance(exc, OSError) and not exc.filename:
            raise OSError(exc.errno, exc.strerror, str(path)) from exc
        raise
    fsync_folder(path.parent)
    return out


def write_bytes(path, data: bytes) -> Path:
    """``data`` into ``path`` atomically (:func:`write_atomic`)."""
    write_atomic(path, lambda tmp: Path(tmp).write_bytes(data))
    return Path(path)


def write_text(path, text: str) -> Path:
    """``text`` (UTF-8) into ``path`` atomically."""
    return write_bytes(path, text.encode("utf-8"))


def write_json(path, obj, *, indent: int | None = 1, sort_keys: bool = False, newline: bool = False) -> Path:
    """``obj`` as JSON into ``path`` atomically (``newline``: end the file with one)."""
    return write_text(path, json.dumps(obj, indent=indent, sort_keys=sort_keys) + ("\n" if newline else ""))


def write_safetensors_file(path, tensors: dict, metadata: dict[str, str] | None = None) -> Path:
    """``tensors`` (name -> torch tensor) in the safetensors format into ``path`` atomically, written by the
    safetensors library (a writer that hashes while it writes is ZeRO's ``integrity.write_safetensors``)."""
    from safetensors.torch import save_file

    tensors = {k: v.contiguous() for k, v in tensors.items()}
    write_atomic(path, lambda tmp: save_file(tensors, str(tmp), metadata=metadata))
    return Path(path)


def replace_folder(staging, final, aside) -> None:
    """Move the finished folder ``staging`` to ``final``. A folder already at ``final`` is first renamed to
    ``aside`` (which the caller removes once it has recorded the new one), and put back if the move fails;
    the parent folder is fsynced after the move."""
    staging, final, aside = Path(staging), Path(final), Path(aside)
    if final.exists():
        if aside.exists():
            shutil.rmtree(aside)
        os.replace(final, aside)
    try:
        os.replace(staging, final)
    except OSError:
        if aside.exists() and not final.exists():
            os.replace(aside, final)
        raise
    fsync_folder(final.parent)


# ----------------------------------------------------------------- digests
ALGORITHM = "sha256-of-chunk-sha256"
CHUNK_BYTES = 16 * 2**20

_pool_lock = threading.Lock()
_pool: ThreadPoolExecutor | None = None


def pool() -> ThreadPoolExecutor:
    """The hashing threads (one per core, at most 16), started on first use, shared by every writer and
    check."""
    global _pool
    with _pool_lock:
        if _pool is None:
            affinity = getattr(os, "sched_getaffinity", None)
            cores = len(affinity(0)) if affinity else (os.cpu_count() or 1)
            _pool = ThreadPoolExecutor(max(1, min(16, cores)), thread_name_prefix="polyaccel-file-hash")
        return _pool


def _sha256(buf) -> bytes:
    return hashlib.sha256(buf).digest()


class ChunkHasher:
    """The :data:`ALGORITHM` digest of a byte stream fed in pieces of any size, pieces hashed in the pool."""

    def __init__(self, chunk: int = CHUNK_BYTES):
        self.chunk = chunk
        self.size = 0
        self._pending = bytearray()
        self._futures = []

    def feed(self, data) -> None:
        mv = memoryview(data).cast("B")
        self.size += len(mv)
        if self._pending:
            take = min(self.chunk - len(self._pending), len(mv))
            self._pending += mv[:take]
            mv = mv[take:]
            if len(self._pending) == self.chunk:
                self._futures.append(pool().submit(_sha256, self._pending))  # handed over, not copied
                self._pending = bytearray()
        whole = len(mv) - len(mv) % self.chunk
        # zero-copy: the caller keeps ``data`` alive until hexdigest()
        for off in range(0, whole, self.chunk):
            self._futures.append(pool().submit(_sha256, mv[off:off + self.chunk]))
        if whole < len(mv):
            self._pending += mv[whole:]

    def hexdigest(self) -> str:
        if self._pending:
            self._futures.append(pool().submit(_sha256, self._pending))
            self._pending = bytearray()
        return hashlib.sha256(b"".join(f.result() for f in self._futures)).hexdigest()


def file_digest(path, chunk: int = CHUNK_BYTES) -> tuple[int, str]:
    """(size, :data:`ALGORITHM` digest) of a file on disk, its pieces read and hashed in parallel."""
    fd = os.open(str(path), os.O_RDONLY)
    try:
        size = os.fstat(fd).st_size

        def piece(off: int) -> bytes:
            return _sha256(os.pread(fd, min(chunk, size - off), off))

        digests = list(pool().map(piece, range(0, size, chunk)))
    finally:
        os.close(fd)
    return size, hashlib.sha256(b"".join(digests)).hexdigest()


def file_sha256(path) -> str:
    """The plain SHA-256 of a file's bytes."""
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


# ----------------------------------------------------------------- checksummed JSON
_ZEROS = "0" * 64
_JSON_PREFIX = '{\n "checksum": "'


def dumps_checked(obj: dict) -> str:
    """``obj`` as indented JSON whose first key ``checksum`` covers the exact text (module docstring)."""
    body = {k: v for k, v in obj.items() if k != "checksum"}
    text = json.dumps({"checksum": _ZEROS, **body}, indent=1)
    return text.replace(_ZEROS, hashlib.sha256(text.encode()).hexdigest(), 1)


def loads_checked(raw: bytes, path, fix: str) -> tuple[dict, bool]:
    """(object, whether it carried a checksum) of a JSON file's bytes; a damaged file raises
    :class:`CheckpointError` naming ``path`` and ending with ``fix``. A checksum present is verified."""
    checked = raw.startswith(_JSON_PREFIX.encode())
    if checked:
        start = len(_JSON_PREFIX)
        stored = raw[start:start + 64].decode("ascii", "replace")
        expect = hashlib.sha256(raw[:start] + _ZEROS.encode() + raw[start + 64:]).hexdigest()
        if stored != expect:
            raise CheckpointError(f"{path}: checksum mismatch, the file is damaged ({len(raw)} bytes); {fix}",
                                  path)
    try:
        obj = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        what = "empty" if not raw.strip() else f"not valid JSON ({exc})"
        raise CheckpointError(f"{path}: the file is {what}, it is damaged or truncated; {fix}",
                              path) from None
    if not isinstance(obj, dict):
        raise CheckpointError(f"{path}: holds a JSON {type(obj).__name__}, not an object; it is damaged; "
                              f"{fix}", path)
    obj.pop("checksum", None)
    return obj, checked


def read_checked_json(path, fix: str) -> tuple[dict, bool]:
    """:func:`loads_checked` of a file; a missing or unreadable one raises :class:`CheckpointError`."""
    try:
        raw = Path(path).read_bytes()
    except FileNotFoundError:
        raise CheckpointError(f"{path}: missing; {fix}", path) from None
    except OSError as exc:
        raise CheckpointError(f"{path}: cannot be read ({exc.strerror or exc}); {fix}", path) from None
    return loads_checked(raw, path, fix)


def write_checked_json(path, obj: dict) -> Path:
    """``obj`` with its checksum (:func:`dumps_checked`) into ``path`` atomically."""
    return write_text(path, dumps_checked(obj))


def read_record(path, format: str, fix: str) -> dict:
    """A checksummed JSON file whose ``format`` key is ``format``: one without a checksum, or of another
    format, is refused naming the file."""
    obj, checked = read_checked_json(path, fix)
    if not checked:
        raise CheckpointError(f"{path}: carries no checksum, so it cannot be trusted; {fix}", path)
    if obj.get("format") != format:
        raise CheckpointError(f"{path}: not a {format} file (its format is {obj.get('format')!r}); {fix}",
                              path)
    return obj


# ----------------------------------------------------------------- records of files
def record_files(folder, names) -> dict[str, dict]:
    """``{name: {"bytes": size, "sha256": plain SHA-256}}`` of the files ``names`` directly in ``folder``."""
    folder = Path(folder)
    return {name: {"bytes": (folder / name).stat().st_size, "sha256": file_sha256(folder / name)}
            for name in sorted(names)}


def check_files(folder, files: dict[str, dict], fix: str, listed_by: str) -> None:
    """Every file of a :func:`record_files` record is in ``folder``, at its size, with its SHA-256; the first
    that is not raises :class:`CheckpointError` naming it, what is wrong (missing, truncated or longer,
    damaged) and ``fix``. ``listed_by`` names the record in the missing file's message."""
    folder = Path(folder)
    for name, rec in files.items():
        p = folder / name
        if not p.is_file():
            raise CheckpointError(f"{p}: missing ({listed_by} lists it); {fix}", p)
        size = p.stat().st_size
        if size != rec["bytes"]:
            how = "truncated" if size < rec["bytes"] else "longer than written"
            raise CheckpointError(f"{p}: {size} bytes, {rec['bytes']} when saved: the file is {how}; {fix}",
                                  p)
        if file_sha256(p) != rec["sha256"]:
            raise CheckpointError(f"{p}: checksum mismatch, the file is damaged (its SHA-256 differs from "
                                  f"the one recorded at save); {fix}", p)


__all__ = ["ALGORITHM", "CHUNK_BYTES", "ChunkHasher", "check_files", "dumps_checked", "file_digest",
           "file_sha256", "fsync_folder", "loads_checked", "pool", "read_checked_json", "read_record",
           "record_files", "replace_folder", "sync_file", "write_atomic", "write_bytes", "write_checked_json",
           "write_json", "write_safetensors_file", "write_text"]
