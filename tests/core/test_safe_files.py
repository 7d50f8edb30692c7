"""polyaccel.safe_files: a failed write leaves the old file; a damaged file is refused naming it and what is
wrong; records round-trip; and no module outside it renames or fsyncs files on its own."""

from __future__ import annotations

import ast
import hashlib
import json
import os
import random
from pathlib import Path

import pytest
from polyaccel import safe_files
from polyaccel.errors import CheckpointError

ROOT = Path(__file__).resolve().parents[2]


def _random_obj(rng: random.Random, depth: int = 0):
    kind = rng.randrange(6 if depth < 3 else 4)
    if kind == 0:
        return rng.randint(-2**40, 2**40)
    if kind == 1:
        return rng.random() * 10 ** rng.randint(-5, 5)
    if kind == 2:
        return "".join(chr(rng.choice([rng.randint(32, 126), rng.randint(0xA0, 0x2FFF)]))
                       for _ in range(rng.randint(0, 12)))
    if kind == 3:
        return rng.choice([True, False, None])
    if kind == 4:
        return [_random_obj(rng, depth + 1) for _ in range(rng.randint(0, 4))]
    return {f"k{rng.randint(0, 999)}": _random_obj(rng, depth + 1) for _ in range(rng.randint(0, 4))}


def _files(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir())


# ----------------------------------------------------------------- atomic writes
@pytest.mark.parametrize("how", ["mid_write", "at_fsync", "at_rename"])
def test_interrupted_write_leaves_the_old_file_and_no_temporary(tmp_path, monkeypatch, how):
    target = tmp_path / "state.bin"
    old = os.urandom(1000)
    target.write_bytes(old)
    new = os.urandom(3000)

    class Crash(Exception):
        pass

    def write(tmp):
        with open(tmp, "wb") as f:
            f.write(new[:1500])  # half the new content is on disk under the temporary name
            if how == "mid_write":
                raise Crash()
            f.write(new[1500:])

    def crash(*args, **kwargs):
        raise Crash()

    if how == "at_fsync":
        monkeypatch.setattr(safe_files.os, "fsync", crash)
    if how == "at_rename":
        monkeypatch.setattr(safe_files.os, "replace", crash)
    with pytest.raises(Crash):
        safe_files.write_atomic(target, write)
    assert target.read_bytes() == old
    assert _files(tmp_path) == ["state.bin"]  # the temporary file is gone

    monkeypatch.undo()
    safe_files.write_bytes(target, new)
    assert target.read_bytes() == new
    assert _files(tmp_path) == ["state.bin"]


def test_a_failed_write_naming_no_file_is_raised_naming_the_target(tmp_path):
    target = tmp_path / "out.json"

    def write(tmp):
        raise OSError(28, "No space left on device")

    with pytest.raises(OSError) as info:
        safe_files.write_atomic(target, write)
    assert info.value.filename == str(target) and info.value.errno == 28
    assert not target.exists() and _files(tmp_path) == []


def test_write_atomic_returns_the_writers_result_and_keeps_the_umask_mode(tmp_path):
    target = tmp_path / "a.txt"
    assert safe_files.write_atomic(target, lambda tmp: Path(tmp).write_text("hello") and "done") == "done"
    assert target.read_text() == "hello"
    umask = os.umask(0)
    os.umask(umask)
    assert target.stat().st_mode & 0o777 == 0o666 & ~umask  # as open() would have made it, not mkstemp's 0600


def test_safetensors_file_round_trips_and_a_failed_write_keeps_the_old_one(tmp_path, monkeypatch):
    import torch
    from safetensors.torch import load_file

    path = tmp_path / "model.safetensors"
    old = {"w": torch.randn(3, 5, dtype=torch.float64), "b": torch.randn(7).to(torch.bfloat16)}
    safe_files.write_safetensors_file(path, {"w": old["w"].t(), "b": old["b"]}, {"format": "pt"})  # w strided
    back = load_file(path)
    assert torch.equal(back["w"], old["w"].t()) and torch.equal(back["b"], old["b"])
    monkeypatch.setattr(safe_files.os, "replace", lambda *a: (_ for _ in ()).throw(OSError(5, "I/O error")))
    with pytest.raises(OSError) as info:
        safe_files.write_safetensors_file(path, {"w": torch.zeros(2)})
    assert info.value.filename == str(path)
    assert torch.equal(load_file(path)["w"], old["w"].t()) and _files(tmp_path) == ["model.safetensors"]


def test_replace_folder_moves_the_old_folder_aside_and_back_when_the_move_fails(tmp_path, monkeypatch):
    final, aside, staging = tmp_path / "tag", tmp_path / ".tag.old", tmp_path / ".tag.partial"
    final.mkdir()
    (final / "f").write_text("old")
    staging.mkdir()
    (staging / "f").write_text("new")
    real = os.replace

    def fail_on_staging(src, dst):
        if Path(src) == staging:
            raise OSError(5, "Input/output error")
        real(src, dst)

    monkeypatch.setattr(safe_files.os, "replace", fail_on_staging)
    with pytest.raises(OSError):
        safe_files.replace_folder(staging, final, aside)
    assert (final / "f").read_text() == "old" and not aside.exists()
    monkeypatch.undo()
    safe_files.replace_folder(staging, final, aside)
    assert (final / "f").read_text() == "new" and (aside / "f").read_text() == "old" and not staging.exists()


# ----------------------------------------------------------------- checksummed JSON records
def test_checked_json_round_trips_fresh_random_content(tmp_path):
    rng = random.Random(os.urandom(8))
    for i in range(20):
        obj = {"format": "test-record", **{f"key{j}": _random_obj(rng) for j in range(rng.randint(1, 6))}}
        path = safe_files.write_checked_json(tmp_path / f"r{i}.json", obj)
        raw = path.read_bytes()
        assert raw.startswith(b'{\n "checksum": "')
        stored = json.loads(raw)["checksum"]  # an independent check of the scheme: digits zeroed, SHA-256
        assert stored == hashlib.sha256(raw.replace(stored.encode(), b"0" * 64, 1)).hexdigest()
        back, checked = safe_files.read_checked_json(path, "fix it")
        assert checked and back == obj
        assert safe_files.read_record(path, "test-record", "fix it") == obj


def _damaged(tmp_path, how: str) -> Path:
    record = {"format": "test-record", "x": os.urandom(8).hex()}
    path = safe_files.write_checked_json(tmp_path / "meta.json", record)
    raw = path.read_bytes()
    if how == "truncated":
        path.write_bytes(raw[:len(raw) // 2])
    elif how == "flipped":
        i = raw.index(b'"x": "') + 7
        path.write_bytes(raw[:i] + (b"0" if raw[i:i + 1] != b"0" else b"1") + raw[i + 1:])
    elif how == "empty":
        path.write_bytes(b"")
    elif how == "missing":
        path.unlink()
    return path


@pytest.mark.parametrize("how,what", [("truncated", "checksum mismatch"), ("flipped", "checksum mismatch"),
                                      ("empty", "empty"), ("missing", "missing")])
def test_a_damaged_checked_json_is_refused_naming_the_file_and_the_damage(tmp_path, how, what):
    path = _damaged(tmp_path, how)
    with pytest.raises(CheckpointError) as info:
        safe_files.read_checked_json(path, "restore it")
    text = str(info.value)
    assert str(path) in text and what in text and text.endswith("restore it") and "\n" not in text
    assert Path(info.value.path) == path


def test_read_record_refuses_a_foreign_format_and_a_file_without_checksum(tmp_path):
    other = safe_files.write_checked_json(tmp_path / "other.json", {"format": "something-else"})
    with pytest.raises(CheckpointError, match=r"other\.json: not a test-record file .*'something-else'"):
        safe_files.read_record(other, "test-record", "fix")
    plain = safe_files.write_json(tmp_path / "plain.json", {"format": "test-record"})
    with pytest.raises(CheckpointError, match=r"plain\.json: carries no checksum"):
        safe_files.read_record(plain, "test-record", "fix")
    listed = safe_files.write_json(tmp_path / "list.json", [1, 2])
    with pytest.raises(CheckpointError, match=r"list\.json: holds a JSON list, not an object"):
        safe_files.read_checked_json(listed, "fix")


# ----------------------------------------------------------------- records of files, digests
def test_file_records_name_the_missing_truncated_longer_or_altered_file(tmp_path):
    blobs = {f"f{i}.bin": os.urandom(random.randint(1, 5000)) for i in range(3)}
    for name, data in blobs.items():
        (tmp_path / name).write_bytes(data)
    files = safe_files.record_files(tmp_path, blobs)
    assert files == {n: {"bytes": len(d), "sha256": hashlib.sha256(d).hexdigest()} for n, d in blobs.items()}
    safe_files.check_files(tmp_path, files, "fix", listed_by="the list")
    cases = [("f0.bin", lambda d: d[:-1], "the file is truncated"),
             ("f1.bin", lambda d: d + b"x", "longer than"),
             ("f2.bin", lambda d: bytes([d[0] ^ 1]) + d[1:], "checksum mismatch")]
    for name, change, what in cases:
        (tmp_path / name).write_bytes(change(blobs[name]))
        with pytest.raises(CheckpointError) as info:
            safe_files.check_files(tmp_path, files, "fix", listed_by="the list")
        assert str(tmp_path / name) in str(info.value) and what in str(info.value)
        (tmp_path / name).write_bytes(blobs[name])
    (tmp_path / "f1.bin").unlink()
    with pytest.raises(CheckpointError, match=r"f1\.bin: missing \(the list lists it\)"):
        safe_files.check_files(tmp_path, files, "fix", listed_by="the list")


def test_chunk_digest_of_a_stream_and_of_the_file_match_an_independent_reference(tmp_path):
    chunk = 1000
    data = os.urandom(random.randint(3 * chunk, 7 * chunk))
    pieces = [data[i:i + chunk] for i in range(0, len(data), chunk)]
    expect = hashlib.sha256(b"".join(hashlib.sha256(p).digest() for p in pieces)).hexdigest()
    hasher = safe_files.ChunkHasher(chunk)
    cut = sorted(random.sample(range(1, len(data)), 9))
    for a, b in zip([0, *cut], [*cut, len(data)], strict=True):  # pieces that straddle the chunk boundaries
        hasher.feed(data[a:b])
    assert (hasher.size, hasher.hexdigest()) == (len(data), expect)
    (tmp_path / "blob").write_bytes(data)
    assert safe_files.file_digest(tmp_path / "blob", chunk) == (len(data), expect)
    (tmp_path / "empty").write_bytes(b"")
    assert safe_files.file_digest(tmp_path / "empty", chunk) == (0, hashlib.sha256(b"").hexdigest())


# ----------------------------------------------------------------- nobody else renames or fsyncs
#: calls that make a file appear under its final name or put it on disk; only polyaccel.safe_files makes them
FILE_COMMIT_CALLS = {("os", "replace"), ("os", "rename"), ("os", "renames"), ("os", "fsync"),
                     ("os", "fdatasync"), ("tempfile", "mkstemp"), ("tempfile", "NamedTemporaryFile")}
#: files that may make them anyway, each with the reason
ALLOWED = {"core/safe_files.py": "the one module that does"}


def file_commit_calls(source: str) -> list[tuple[int, str]]:
    """(line, what) of every use of :data:`FILE_COMMIT_CALLS` in ``source`` (attribute, ``from`` import, or
    ``Path.rename``)."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and \
                (node.value.id, node.attr) in FILE_COMMIT_CALLS:
            found.append((node.lineno, f"{node.value.id}.{node.attr}"))
        elif isinstance(node, ast.Attribute) and node.attr in ("rename", "renames"):
            found.append((node.lineno, f".{node.attr}"))
        elif isinstance(node, ast.ImportFrom) and node.module in ("os", "tempfile"):
            found += [(node.lineno, f"from {node.module} import {a.name}") for a in node.names
                      if (node.module, a.name) in FILE_COMMIT_CALLS]
    return found


def test_the_checker_sees_each_way_of_calling():
    source = ("import os, tempfile\nfrom os import fsync\nos.replace(a, b)\ntempfile.mkstemp()\n"
              "p.rename(q)\nos.path.join(a)\ns.replace('a', 'b')\n")
    found = sorted(w for _, w in file_commit_calls(source))
    assert found == [".rename", "from os import fsync", "os.replace", "tempfile.mkstemp"]


def test_only_safe_files_renames_or_fsyncs():
    found = []
    for folder in ("core", "engines", "apps", "integrations", "plugins", "benchmarks", "examples"):
        for path in sorted((ROOT / folder).rglob("*.py")):
            rel = path.relative_to(ROOT).as_posix()
            if rel in ALLOWED:
                continue
            found += [f"{rel}:{line} {what}" for line, what in file_commit_calls(path.read_text())]
    assert not found, ("write files through polyaccel.safe_files (write_atomic, write_bytes, write_json, "
                       "replace_folder ...), not by hand:\n" + "\n".join(found))
