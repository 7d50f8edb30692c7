"""Importing a polyaccel module does nothing until it is used: every module under polyaccel (core, plugins,
engines, apps, integrations) imports in one process whose environment holds a malformed value for every
setting polyaccel reads, without raising, and leaves Lightning's accelerator and strategy registries as they
were and DeepSpeed unimported."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

#: a malformed value for every environment setting polyaccel (or a plugin) reads at use
HOSTILE_ENV = {
    "POLYACCEL_TRITON_OPTIM_CONFIG": "not,a,config",
    "POLYACCEL_ACCELERATOR": "no-such-plugin",
    "POLYACCEL_PLUGINS": "no-such-plugin",
    "POLYACCEL_DISABLE_PLUGINS": ",,,",
    "POLYACCEL_OP_OVERRIDES": "fused_adam=:::",
    "POLYACCEL_COMM_TIMEOUT": "-forever",
    "POLYACCEL_API_VERSION": "x.y",
    "POLYACCEL_METAL_EMULATION_CACHE": "/nonexistent/metal-cache",
}

IMPORT_ALL = textwrap.dedent('''
    import importlib, importlib.util, json, pkgutil, sys, traceback
    from lightning.pytorch.accelerators import AcceleratorRegistry
    from lightning.pytorch.strategies import StrategyRegistry

    def registries():
        return {"accelerators": sorted(AcceleratorRegistry), "strategies": sorted(StrategyRegistry)}

    before = registries()
    names, failures, missing = [], {}, {}
    tops = ("polyaccel", "polyaccel.plugins", "polyaccel.engines", "polyaccel.apps", "polyaccel.integrations")
    for top in tops:
        package = importlib.import_module(top)
        names.append(top)
        found = pkgutil.walk_packages(package.__path__, top + ".", onerror=lambda name: None)
        names += [m.name for m in found if m.name.rsplit(".", 1)[-1] != "__main__"]
    for name in sorted(set(names)):
        try:
            importlib.import_module(name)
        except ModuleNotFoundError as exc:
            root = (exc.name or "").split(".")[0]
            if root and root != "polyaccel" and importlib.util.find_spec(root) is None:
                missing[name] = root  # an optional dependency that is not installed here
            else:
                failures[name] = traceback.format_exc()
        except BaseException:
            failures[name] = traceback.format_exc()
    print(json.dumps({"modules": len(set(names)), "failures": failures, "missing": missing, "before": before,
                      "after": registries(), "deepspeed_imported": "deepspeed" in sys.modules}))
''')


def test_every_module_imports_under_a_hostile_environment_and_acts_on_nothing():
    env = {k: v for k, v in os.environ.items() if not k.startswith("POLYACCEL_")}
    env.update(HOSTILE_ENV, TORCH_DEVICE_BACKEND_AUTOLOAD="0",
               OMP_NUM_THREADS="1")
    out = subprocess.run([sys.executable, "-c", IMPORT_ALL], capture_output=True, text=True, env=env,
                         timeout=240)
    assert out.returncode == 0, out.stderr[-4000:]
    res = json.loads(out.stdout.strip().splitlines()[-1])
    assert res["modules"] > 100, res["modules"]  # the walk found the tree, not one package
    assert res["failures"] == {}, "\n".join(res["failures"].values())[-6000:]
    assert set(res["missing"].values()) <= {"deepspeed"}, res["missing"]  # the one extra not installed here
    assert res["after"] == res["before"]  # Lightning's registries: polyaccel.integrations.lightning left them
    assert "polyaccel" not in res["after"]["accelerators"]
    assert not res["deepspeed_imported"]  # polyaccel.integrations.deepspeed imports DeepSpeed at install()


def test_the_optimizer_kernel_config_from_the_environment_is_refused_at_use(monkeypatch):
    """``POLYACCEL_TRITON_OPTIM_CONFIG`` is read where a launch configuration is wanted, and a malformed value
    is refused there with its name; a well-formed one is what the kernels get."""
    import pytest
    from polyaccel.errors import ConfigError
    from polyaccel.plugins.cuda.kernels import chunk_table

    monkeypatch.setenv("POLYACCEL_TRITON_OPTIM_CONFIG", "not,a,config")
    bad = "POLYACCEL_TRITON_OPTIM_CONFIG='not,a,config' is not 'BLOCK,ITERS,WARPS'"
    with pytest.raises(ConfigError, match=bad):
        chunk_table.launch_config()
    monkeypatch.setenv("POLYACCEL_TRITON_OPTIM_CONFIG", "48,2,4")
    with pytest.raises(ConfigError, match="BLOCK must be a power of two >= 16, got 48"):
        chunk_table.launch_config()
    monkeypatch.setenv("POLYACCEL_TRITON_OPTIM_CONFIG", "64,3,2")
    assert chunk_table.launch_config() == (64, 3, 2)
    chunk_table.set_launch_config(32, 2, 1)  # set in code: wins over the environment
    try:
        assert chunk_table.launch_config() == (32, 2, 1)
    finally:
        chunk_table.set_launch_config(None)
    assert chunk_table.launch_config() == (64, 3, 2)
