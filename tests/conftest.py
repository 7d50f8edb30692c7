"""Test-wide set-up: offline HF, Triton kernels on the CPU interpreter, fresh selection per test."""

import os

# must happen before any triton kernel module is imported
os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TORCH_DEVICE_BACKEND_AUTOLOAD", "0")

import pytest  # noqa: E402


@pytest.fixture(autouse=True)
def _fresh_polyaccel(monkeypatch):
    """Each test starts with no plugin discovered and no accelerator selected, and leaves no process group.

    A world of one that a test initialised and left behind (an engine it never destroyed) would be adopted by
    the next test's ``initialize`` in the same worker; one a higher-scoped fixture holds is left alone.
    """
    for var in ("POLYACCEL_ACCELERATOR", "POLYACCEL_PLUGINS", "POLYACCEL_DISABLE_PLUGINS",
                "POLYACCEL_DISABLE_PLUGIN_AUTOLOAD", "POLYACCEL_OP_OVERRIDES"):
        monkeypatch.delenv(var, raising=False)
    from polyaccel import comm, selection

    world_before = comm.is_initialized()
    selection.reset()
    yield
    if not world_before and comm.is_initialized():
        comm.destroy()
    selection.reset()


@pytest.fixture
def no_spawn(monkeypatch):
    """Fail the test if ``polyaccel train``'s launcher is reached (argument checks must refuse first)."""
    from polyaccel.apps.train import launcher

    def forbidden(opts):
        raise AssertionError(f"ranks were spawned for {opts}")

    monkeypatch.setattr(launcher, "launch", forbidden)


@pytest.fixture
def count_launches(monkeypatch):
    """``count_launches(module, name)``: the launch grids of the Triton kernel ``module.name``, appended to the
    list it returns as the kernel launches (it still runs)."""

    def install(module, name: str) -> list:
        grids = []
        real = getattr(module, name)

        class Counted:
            def __getitem__(self, grid):
                grids.append(grid)
                return real[grid]

        monkeypatch.setattr(module, name, Counted())
        return grids

    return install
