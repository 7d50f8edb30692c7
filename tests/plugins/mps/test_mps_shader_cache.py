"""The emulated Metal runtime's per-user library cache: where it lives, what it refuses, that it is reused."""

from __future__ import annotations

import os
import stat
import subprocess
import uuid

import pytest
import torch
from polyaccel.errors import PolyaccelError
from polyaccel.plugins.mps import emulation as mps
from polyaccel.testing.emulation import emulate

SOURCE = """#include <metal_stdlib>
using namespace metal;
kernel void axpb(device float* x, constant float& a, uint i [[thread_position_in_grid]]) {
    x[i] = x[i] * a + %s;
}
"""


@pytest.fixture
def fresh(monkeypatch, tmp_path):
    """A fresh builder (no library loaded in-process), no cache variable, XDG cache under tmp_path."""
    build = mps._HostBuild()
    monkeypatch.setattr(mps, "_BUILD", build)
    monkeypatch.delenv(mps.CACHE_ENV, raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    return build


@pytest.fixture
def no_load(monkeypatch):
    """ctypes.CDLL and the compiler, recorded; CDLL fails the test if it is ever reached."""
    loaded, compiled = [], []

    def cdll(path, *a, **k):
        loaded.append(path)
        raise AssertionError(f"ctypes.CDLL was called with {path}")

    real_run = subprocess.run

    def run(cmd, *a, **k):
        compiled.append(cmd)
        return real_run(cmd, *a, **k)

    monkeypatch.setattr(mps.ctypes, "CDLL", cdll)
    monkeypatch.setattr(mps.subprocess, "run", run)
    return loaded, compiled


def _source() -> str:
    return SOURCE % f"{uuid.uuid4().int % 1000}.0f"  # a key no other test has built


def _cpp(source: str) -> str:
    kernels = mps.parse_kernels(source)
    return (mps._SHIM + source.replace("#include <metal_stdlib>", "") + "\n"
            + "".join(mps._launcher(n, p) for n, p in kernels.items()))


def _plant(folder, source: str):
    """A file under the exact name the build would load for ``source``."""
    planted = folder / f"{mps._HostBuild.key(mps._HostBuild.compiler(), _cpp(source))}.so"
    planted.write_bytes(b"\x7fELF planted by someone else")
    return planted


def _compile(source: str):
    with emulate("mps") as rt:
        return rt.compile_shader(source)


# ------------------------------------------------------------------------------------ location
def test_default_cache_is_per_user_under_xdg_cache_home_with_mode_0700(fresh, tmp_path):
    folder = mps._HostBuild.cache_dir()
    assert folder == os.path.realpath(tmp_path / "xdg" / "polyaccel" / "metal-emulation")
    assert stat.S_IMODE(os.stat(folder).st_mode) == 0o700


def test_default_cache_without_xdg_is_under_home(monkeypatch, tmp_path):
    monkeypatch.delenv(mps.CACHE_ENV, raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", "relative/ignored")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert mps.default_cache_dir() == str(tmp_path / "home" / ".cache" / "polyaccel" / "metal-emulation")
    monkeypatch.delenv("XDG_CACHE_HOME")
    assert mps.default_cache_dir() == str(tmp_path / "home" / ".cache" / "polyaccel" / "metal-emulation")


def test_cache_is_not_in_the_shared_temp_dir(monkeypatch):
    monkeypatch.delenv(mps.CACHE_ENV, raising=False)
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    assert mps.default_cache_dir() == os.path.join(os.path.expanduser("~"), ".cache", "polyaccel",
                                                   "metal-emulation")


# --------------------------------------------------------------------------------- refusals
def _folder(how: str, tmp_path, monkeypatch):
    """The cache folder to pre-create: the default one, or one named by the environment variable."""
    if how == "env":
        folder = tmp_path / "configured"
        monkeypatch.setenv(mps.CACHE_ENV, str(folder))
    else:
        folder = tmp_path / "xdg" / "polyaccel" / "metal-emulation"
    folder.mkdir(parents=True, mode=0o700)
    folder.chmod(0o700)
    return folder


@pytest.mark.parametrize("how", ["default", "env"])
def test_folder_of_another_user_is_refused_and_nothing_in_it_loaded(fresh, no_load, tmp_path, monkeypatch, how):
    folder = _folder(how, tmp_path, monkeypatch)
    source = _source()
    planted = _plant(folder, source)
    monkeypatch.setattr(os, "getuid", lambda: os.stat(folder).st_uid + 4242)  # the folder is someone else's
    with pytest.raises(mps.UnsafeCacheError) as info:
        _compile(source)
    msg = str(info.value)
    assert isinstance(info.value, PolyaccelError)
    assert os.path.realpath(folder) in msg and "not by the current user" in msg
    assert mps.CACHE_ENV in msg and "Remove that folder" in msg
    loaded, compiled = no_load
    assert loaded == [] and compiled == []
    assert sorted(os.listdir(folder)) == [planted.name]


@pytest.mark.parametrize("how", ["default", "env"])
@pytest.mark.parametrize("mode", [0o777, 0o770, 0o702])
def test_writable_folder_is_refused_and_nothing_in_it_loaded(fresh, no_load, tmp_path, monkeypatch, how, mode):
    folder = _folder(how, tmp_path, monkeypatch)
    source = _source()
    planted = _plant(folder, source)
    folder.chmod(mode)
    with pytest.raises(mps.UnsafeCacheError) as info:
        _compile(source)
    msg = str(info.value)
    assert os.path.realpath(folder) in msg and "group/world-writable" in msg and f"chmod 700 {folder}" in msg
    loaded, compiled = no_load
    assert loaded == [] and compiled == []
    assert sorted(os.listdir(folder)) == [planted.name]
    assert stat.S_IMODE(os.stat(folder).st_mode) == mode, "the folder is refused, not silently changed"


def test_folder_under_a_world_writable_parent_without_sticky_bit_is_refused(fresh, no_load, tmp_path, monkeypatch):
    parent = tmp_path / "open"
    parent.mkdir()
    parent.chmod(0o777)
    monkeypatch.setenv(mps.CACHE_ENV, str(parent / "cache"))
    with pytest.raises(mps.UnsafeCacheError, match="world-writable without the sticky bit") as info:
        _compile(_source())
    assert os.path.realpath(parent) in str(info.value)
    assert no_load == ([], [])


def test_symlinked_env_folder_to_a_foreign_folder_is_refused(fresh, no_load, tmp_path, monkeypatch):
    target = tmp_path / "theirs"
    target.mkdir(mode=0o700)
    source = _source()
    _plant(target, source)
    link = tmp_path / "mine"
    link.symlink_to(target)
    monkeypatch.setenv(mps.CACHE_ENV, str(link))
    real_uid, real_target = os.stat(target).st_uid, os.path.realpath(target)
    real_lstat = os.lstat

    def lstat(path, *a, **k):  # only the link's target belongs to someone else
        st = real_lstat(path, *a, **k)
        if os.fspath(path) == real_target:
            return os.stat_result((st.st_mode, st.st_ino, st.st_dev, st.st_nlink, real_uid + 4242) + tuple(st)[5:])
        return st

    monkeypatch.setattr(os, "lstat", lstat)
    with pytest.raises(mps.UnsafeCacheError, match="not by the current user") as info:
        _compile(source)
    assert os.path.realpath(target) in str(info.value)
    assert no_load == ([], [])


@pytest.mark.parametrize("problem", ["foreign owner", "writable", "symlink"])
def test_unsafe_library_in_a_safe_folder_is_never_loaded(fresh, no_load, tmp_path, monkeypatch, problem):
    folder = _folder("env", tmp_path, monkeypatch)
    source = _source()
    planted = _plant(folder, source)
    if problem == "writable":
        planted.chmod(0o666)
    elif problem == "symlink":
        elsewhere = tmp_path / "elsewhere.so"
        planted.rename(elsewhere)
        planted.symlink_to(elsewhere)
    else:
        real_lstat, real_planted = os.lstat, os.path.join(os.path.realpath(folder), planted.name)

        def lstat(path, *a, **k):
            st = real_lstat(path, *a, **k)
            if os.fspath(path) == real_planted:
                return os.stat_result(tuple(st)[:4] + (st.st_uid + 4242,) + tuple(st)[5:])
            return st

        monkeypatch.setattr(os, "lstat", lstat)
    with pytest.raises(mps.UnsafeCacheError, match="refusing to load the cached emulated Metal library") as info:
        _compile(source)
    assert os.path.join(os.path.realpath(folder), planted.name) in str(info.value) and "Delete it" in str(info.value)
    assert no_load == ([], [])


# ------------------------------------------------------------------------------ normal path
def test_builds_caches_and_reuses_the_library(fresh, tmp_path, monkeypatch):
    folder = tmp_path / "new" / "cache"
    monkeypatch.setenv(mps.CACHE_ENV, str(folder))
    loaded, compiled = [], []
    real_cdll, real_run = mps.ctypes.CDLL, subprocess.run
    monkeypatch.setattr(mps.ctypes, "CDLL", lambda path, *a, **k: loaded.append(path) or real_cdll(path, *a, **k))
    monkeypatch.setattr(mps.subprocess, "run", lambda cmd, *a, **k: compiled.append(cmd) or real_run(cmd, *a, **k))
    source = SOURCE % f"{uuid.uuid4().int % 1000}.5f"

    x = torch.arange(5, dtype=torch.float32)
    with emulate("mps") as rt:
        lib = rt.compile_shader(source)
        lib.axpb(x, 2.0)
    offset = float(source.split("+ ")[1].split("f")[0])
    assert torch.equal(x, torch.arange(5, dtype=torch.float32) * 2 + offset)
    assert len(compiled) == 1
    assert stat.S_IMODE(os.stat(folder).st_mode) == 0o700
    names = os.listdir(folder)
    assert len(names) == 1 and names[0].endswith(".so"), names  # no temporary file left behind
    cached = os.path.join(os.path.realpath(folder), names[0])
    st = os.stat(cached)
    assert st.st_uid == os.getuid() and not st.st_mode & 0o022
    assert loaded == [cached]

    _compile(source)  # same process: the loaded library
    monkeypatch.setattr(mps, "_BUILD", mps._HostBuild())  # a new process: the cached file
    y = torch.ones(3)
    with emulate("mps") as rt:
        rt.compile_shader(source).axpb(y, 3.0)
    assert torch.equal(y, torch.full((3,), 3 + offset))
    assert len(compiled) == 1, "the cached library is reused, not rebuilt"
    assert loaded == [cached, cached] and os.listdir(folder) == names


def test_compile_error_leaves_no_temporary_file(fresh, tmp_path, monkeypatch):
    folder = tmp_path / "cache"
    monkeypatch.setenv(mps.CACHE_ENV, str(folder))
    with pytest.raises(RuntimeError, match="does not compile"):
        _compile(SOURCE % "undefined_name")
    assert os.listdir(folder) == []
