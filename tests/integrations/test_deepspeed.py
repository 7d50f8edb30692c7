"""DeepSpeed (the release of the ``polyaccel[deepspeed]`` extra) on polyaccel plugins: deepspeed.initialize on the
cpu plugin and on the example third-party plugin against DeepSpeed's own CPU run (ZeRO-2 with FusedAdam; ZeRO-3
with the optimizer offloaded, DeepSpeedCPUAdam served by polyaccel), and the integration's import.

DeepSpeed lives in its own environment, never in polyaccel's: an overlay virtual environment that sees this
environment's packages (torch, transformers, polyaccel, the example plugin) and adds the extra's DeepSpeed
(installed once with ``DS_BUILD_OPS=0`` and the project's constraints, cached per user). The tests skip, saying
why, only when that environment cannot be built (no package index reachable).
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
WORKER = Path(__file__).with_name("deepspeed_worker.py")


def _deepspeed_requirement() -> str:
    """The requirement of the ``polyaccel[deepspeed]`` extra: the overlay installs what users install."""
    import tomllib

    with open(ROOT / "pyproject.toml", "rb") as f:
        (req,) = tomllib.load(f)["project"]["optional-dependencies"]["deepspeed"]
    return req


DEEPSPEED = _deepspeed_requirement()
STEPS = 5


def _cache_root() -> Path:
    base = os.environ.get("XDG_CACHE_HOME", "")
    if not os.path.isabs(base):
        base = os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "polyaccel"


def overlay_env() -> tuple[Path | None, str]:
    """(python of the DeepSpeed overlay environment, "") or (None, why it could not be built)."""
    purelib = sysconfig.get_paths()["purelib"]
    key = hashlib.sha256(f"{sys.executable}|{purelib}|{DEEPSPEED}".encode()).hexdigest()[:12]
    venv = _cache_root() / f"deepspeed-overlay-{key}"
    python = venv / "bin" / "python"
    done = venv / ".polyaccel-ready"
    venv.parent.mkdir(parents=True, exist_ok=True)
    with open(venv.parent / f".deepspeed-overlay-{key}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # one builder at a time (parallel test workers)
        if done.exists() and python.exists():
            return python, ""
        log = venv.parent / f"deepspeed-overlay-{key}.log"
        with open(log, "w") as out:
            rc = subprocess.run([sys.executable, "-m", "venv", "--clear", str(venv)], stdout=out,
                                stderr=subprocess.STDOUT, timeout=300).returncode
            if rc == 0:
                site = Path(subprocess.check_output(
                    [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                    text=True).strip())
                # this environment's packages (and their .pth files: the editable polyaccel) after the overlay's own
                (site / "_polyaccel_parent_env.pth").write_text(f"import site; site.addsitedir({purelib!r})\n")
                env = dict(os.environ, DS_BUILD_OPS="0", PIP_CONSTRAINT=str(ROOT / "constraints.txt"),
                           PIP_DISABLE_PIP_VERSION_CHECK="1")
                rc = subprocess.run([str(python), "-m", "pip", "install", "-q", DEEPSPEED], env=env, stdout=out,
                                    stderr=subprocess.STDOUT, timeout=900).returncode
        if rc != 0:
            tail = "\n".join(log.read_text(errors="replace").splitlines()[-8:])
            return None, f"could not build DeepSpeed's environment ({DEEPSPEED}; log {log}):\n{tail}"
        done.write_text(DEEPSPEED)
        return python, ""


@pytest.fixture(scope="module")
def ds_python():
    python, why = overlay_env()
    if python is None:
        pytest.skip(why)
    return python


def torchrun(python: Path, out: Path, *args: str, env: dict | None = None) -> dict:
    cmd = [str(python), "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", str(WORKER),
           "--steps", str(STEPS), "--out", str(out), *args]
    full_env = dict(os.environ, HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1", TRANSFORMERS_VERBOSITY="error",
                    **(env or {}))
    log = out.with_suffix(".log")
    with open(log, "w") as fh:
        rc = subprocess.run(cmd, env=full_env, stdout=fh, stderr=subprocess.STDOUT, timeout=400).returncode
    if rc != 0:
        tail = "\n".join(log.read_text(errors="replace").splitlines()[-60:])
        raise AssertionError(f"torchrun {' '.join(args)} failed (rc={rc}):\n{tail}")
    return json.loads(out.read_text())


def test_deepspeed_initialize_on_polyaccel_plugins(ds_python, tmp_path):
    """On the cpu plugin and on the example third-party plugin: DeepSpeed's get_accelerator() is polyaccel's,
    its builders are rebound (also the name deepspeed.ops.adam.fused_adam imported at `import deepspeed`), every
    FusedAdam step runs polyaccel's fused_adam op, and the losses equal DeepSpeed's own CPU run (its compiled CPU
    FusedAdam) to fp32 rounding."""
    native = torchrun(ds_python, tmp_path / "deepspeed.json", "--mode", "deepspeed")
    assert native["ds_accelerator"] == "CPU_Accelerator"
    assert native["optimizer"] == "deepspeed.ops.adam.fused_adam.FusedAdam"
    runs = {}
    for plugin in ("cpu", "example"):
        res = torchrun(ds_python, tmp_path / f"{plugin}.json", "--mode", "polyaccel", "--plugin", plugin)
        runs[plugin] = res
        assert res["ds_accelerator"] == "PolyaccelDeepSpeedAccelerator" and res["is_installed_accelerator"]
        assert res["polyaccel_plugin"] == plugin
        assert res["device_name"] == "cpu" and res["comm_backend"] == "gloo"
        assert set(res["builders"].values()) == {"polyaccel.integrations.deepspeed"}
        assert res["zero_optimizer"] == "DeepSpeedZeroOptimizer"
        assert res["optimizer"] == "deepspeed.ops.adam.fused_adam.FusedAdam"
        assert res["polyaccel_fused_adam_calls"] == STEPS  # one fused_adam op call per step (one flat partition)
        assert "-> cpu_fused_adam" in res["explain"]
        assert "TransformerBuilder is not provided by polyaccel" in res["not_implemented_message"]
        assert f"plugin {plugin!r}" in res["not_implemented_message"]
        # DeepSpeedCPUAdam and FusedLion run polyaccel's ops too, matching torch's AdamW and the Lion formula
        assert res["cpu_adam_calls"] == 3 and res["lion_calls"] == 3
        assert res["cpu_adam_max_diff"] < 1e-6 and res["lion_max_diff"] < 1e-6
        assert "does not support DeepSpeed's CPUAdam rollback" in res["rollback"], res["rollback"]
        assert len(res["losses"]) == STEPS
        diffs = [abs(a - b) for a, b in zip(res["losses"], native["losses"], strict=True)]
        assert max(diffs) <= 1e-5 * max(abs(x) for x in native["losses"]), (res["losses"], native["losses"])
    assert runs["cpu"]["losses"] == runs["example"]["losses"]


def test_deepspeed_zero3_offload_on_polyaccel_equals_deepspeeds_own(ds_python, tmp_path):
    """ZeRO-3 with the optimizer offloaded through polyaccel's DeepSpeed accelerator on the cpu plugin: DeepSpeed's
    Stage-3 optimizer steps with its DeepSpeedCPUAdam, every step served by polyaccel's host Adam (nothing built);
    the losses equal DeepSpeed's own ZeRO-3 offload on its CPU accelerator stepping torch's AdamW on the host."""
    native = torchrun(ds_python, tmp_path / "ds-z3.json", "--mode", "deepspeed", "--zero", "3", "--offload")
    assert native["ds_accelerator"] == "CPU_Accelerator"
    assert native["zero_optimizer"] == "DeepSpeedZeroOptimizer_Stage3"
    assert native["optimizer"] == "torch.optim.adamw.AdamW"
    res = torchrun(ds_python, tmp_path / "pa-z3.json", "--mode", "polyaccel", "--plugin", "cpu", "--zero", "3",
                   "--offload")
    assert res["ds_accelerator"] == "PolyaccelDeepSpeedAccelerator" and res["polyaccel_plugin"] == "cpu"
    assert res["zero_optimizer"] == "DeepSpeedZeroOptimizer_Stage3"
    assert res["optimizer"] == "deepspeed.ops.adam.cpu_adam.DeepSpeedCPUAdam"
    assert res["polyaccel_cpu_adam_calls"] >= STEPS and res["polyaccel_fused_adam_calls"] == 0
    diffs = [abs(a - b) for a, b in zip(res["losses"], native["losses"], strict=True)]
    assert max(diffs) <= 1e-5 * max(abs(x) for x in native["losses"]), (res["losses"], native["losses"])
    assert res["losses"][0] != res["losses"][-1]  # it trained


FALLBACK = "Setting accelerator to CPU"


def test_import_does_not_log_deepspeeds_cpu_fallback(ds_python):
    """``import deepspeed`` logs that it fell back to its CPU accelerator; importing the integration, whose
    install() replaces that accelerator, does not (and install() then puts polyaccel's in force)."""
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env.pop("DS_ACCELERATOR", None)

    def run(code: str) -> str:
        out = subprocess.run([str(ds_python), "-c", code], env=env, capture_output=True, text=True, timeout=120)
        assert out.returncode == 0, out.stderr[-3000:]
        return out.stdout + out.stderr

    assert FALLBACK in run("import deepspeed")  # what the integration keeps out
    text = run("import polyaccel.integrations.deepspeed as pds\n"
               "print('in force:', type(pds.install('cpu')).__name__)")
    assert FALLBACK not in text, text
    assert "in force: PolyaccelDeepSpeedAccelerator" in text


def test_set_device_takes_every_form_deepspeed_passes(ds_python):
    """DeepSpeed calls ``set_device`` with ints, strings and ``torch.device`` objects (ZeRO-3's ``Init`` passes
    its ``local_device``): each reaches the polyaccel accelerator as its index (a device plugin's path; the
    cpu plugin's set_device does nothing, so a recording stand-in takes its place after construction)."""
    code = (
        "import torch, polyaccel, polyaccel.integrations.deepspeed as pds\n"
        "acc = pds.PolyaccelDeepSpeedAccelerator(polyaccel.get_accelerator())\n"
        "calls = []\n"
        "class Device:\n"
        "    def set_device(self, i): calls.append(i)\n"
        "    def current_device(self): return 3\n"
        "acc.polyaccel, acc._host, acc._name = Device(), False, 'cuda'\n"
        "for d in (1, 'cuda:2', torch.device('cuda', 0), torch.device('cuda')): acc.set_device(d)\n"
        "try:\n"
        "    acc.set_device(torch.device('cpu'))\n"
        "except ValueError as exc:\n"
        "    print('refused:', exc)\n"
        "print('calls:', calls)\n")
    out = subprocess.run([str(ds_python), "-c", code], env=dict(os.environ, OMP_NUM_THREADS="1"),
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "calls: [1, 2, 0, 3]" in out.stdout, out.stdout
    assert "refused: set_device(device(type='cpu')): this accelerator's devices are 'cuda'" in out.stdout
