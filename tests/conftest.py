"""Test-wide set-up: offline HF, Triton kernels on the CPU interpreter, fresh selection per test."""

import os

# must happen before any triton kernel module is imported
os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TORCH_DEVICE_BACKEND_AUTOLOAD", "0")

import pytest  # noqa: E402


@pytest.fixture(autouse=True)
def _fresh_polyaccel(monkeypatch):
    """Each test starts with no plugin discovered and no accelerator selected."""
    for var in ("POLYACCEL_ACCELERATOR", "POLYACCEL_PLUGINS", "POLYACCEL_DISABLE_PLUGINS",
                "POLYACCEL_DISABLE_PLUGIN_AUTOLOAD", "POLYACCEL_OP_OVERRIDES"):
        monkeypatch.delenv(var, raising=False)
    from polyaccel import selection

    selection.reset()
    yield
    selection.reset()


@pytest.fixture
def no_spawn(monkeypatch):
    """Fail the test if ``polyaccel train``'s launcher is reached (argument checks must refuse first)."""
    from polyaccel.apps.train import launcher

    def forbidden(opts):
        raise AssertionError(f"ranks were spawned for {opts}")

    monkeypatch.setattr(launcher, "launch", forbidden)
