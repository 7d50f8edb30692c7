"""Intel GPUs through torch's native ``torch.xpu`` (torch >= 2.5); IPEX only when it matches torch."""

from __future__ import annotations

from typing import Any

import torch
from polyaccel.accelerator import Accelerator, ProbeResult
from polyaccel.comm import CommHooks
from polyaccel.errors import ConfigError, Unsupported

from . import ipex as ipex_mod
from .comm import BackendChoice, choose_backend

_NO_XPU_BUILD_HINT = "install torch's XPU wheels (pip install torch --index-url https://download.pytorch.org/whl/xpu)"


def _xpu_module():
    return getattr(torch, "xpu", None)


def graph_support() -> tuple[bool, str]:
    """XPU graphs exist only in torch versions that ship ``torch.xpu.XPUGraph``/``torch.xpu.graph``."""
    mod = _xpu_module()
    if mod is None or not hasattr(mod, "XPUGraph") or not hasattr(mod, "graph"):
        return False, f"torch {torch.__version__} has no torch.xpu.XPUGraph; XPU graphs need torch >= 2.11"
    compiled = getattr(mod, "_is_compiled", None)
    if compiled is not None and not compiled():
        return False, f"torch {torch.__version__} was built without XPU support"
    return True, "torch.xpu.XPUGraph / torch.xpu.graph"


class XpuAccelerator(Accelerator):
    name = "xpu"
    device_type = "xpu"
    priority = 100

    def __init__(self) -> None:
        super().__init__()
        self._ipex: ipex_mod.IpexStatus | None = None
        self._comm: BackendChoice | None = None
        self._caps: frozenset[str] | None = None

    # ------------------------------------------------------------- identity
    def probe(self) -> ProbeResult:
        mod = _xpu_module()
        if mod is None or not hasattr(mod, "is_available"):
            return ProbeResult(False, f"torch {torch.__version__} has no torch.xpu (native XPU support needs "
                                      f"torch >= 2.5)")
        try:
            available = bool(mod.is_available())
        except Exception as exc:  # noqa: BLE001 - a broken runtime is "unavailable, because"
            return ProbeResult(False, f"torch.xpu.is_available() raised {type(exc).__name__}: {exc}")
        if not available:
            compiled = getattr(mod, "_is_compiled", lambda: True)()
            if not compiled:
                reason = f"torch {torch.__version__} is built without XPU support; {_NO_XPU_BUILD_HINT}"
            else:
                reason = ("torch.xpu.is_available() is False: no Intel GPU or no Level Zero driver visible "
                          "(check the GPU driver and ZE_AFFINITY_MASK)")
            verdict = ipex_mod.inspect_ipex()
            if verdict.installed:
                reason += f"; intel-extension-for-pytorch {verdict.version}: {verdict.reason}"
            return ProbeResult(False, reason, details={"ipex": verdict.as_dict()})
        count = int(mod.device_count())
        ipex = self.ipex_status()
        ok, graphs = graph_support()
        return ProbeResult(True, "", count,
                           details={"ipex": ipex.as_dict(), "graphs": graphs if ok else f"unsupported: {graphs}"})

    def ipex_status(self) -> ipex_mod.IpexStatus:
        """IPEX decision for this process: imported (guarded) only when installed and matching torch."""
        if self._ipex is None:
            self._ipex = ipex_mod.load_ipex()
        return self._ipex

    def comm_choice(self) -> BackendChoice:
        if self._comm is None:
            self._comm = choose_backend()
        return self._comm

    @property
    def communication_backend(self) -> str:  # type: ignore[override]
        return self.comm_choice().backend or "unavailable"

    def comm_hooks(self):
        """xccl (or oneCCL's ccl) reads XPU tensors directly: no staging; no backend is a clear error."""
        choice = self.comm_choice()
        if choice.backend is None:
            raise ConfigError(choice.reason)
        return CommHooks(backend=choice.backend)

    def capabilities(self) -> frozenset[str]:
        if self._caps is None:
            caps = {"streams", "events", "rng", "memory_stats", "pinned", "fp16"}
            mod = _xpu_module()
            if mod.is_bf16_supported():
                caps.add("bf16")
            if getattr(mod.get_device_properties(self.current_device()), "has_fp64", False):
                caps.add("fp64")
            if graph_support()[0]:
                caps.add("graphs")
            self._caps = frozenset(caps)
        return self._caps

    def describe(self) -> str:
        return f"xpu ({torch.xpu.get_device_name(self.current_device())})"

    # ---------------------------------------------------------------- device
    def default_stream(self, index: int | None = None):
        """torch.xpu has no ``default_stream()``: the current stream is the default one unless a side
        stream has been made current (the same answer DeepSpeed's xpu accelerator gives)."""
        self.require("streams")
        return torch.xpu.current_stream(index)

    # ---------------------------------------------------------------- graphs
    def _require_graphs(self) -> None:
        ok, why = graph_support()
        if not ok:
            raise Unsupported(self.name, "graphs", f"{why}; use eager execution")

    def create_graph(self):
        self._require_graphs()
        return torch.xpu.XPUGraph()

    def capture_to_graph(self, graph, pool=None, stream=None):
        self._require_graphs()
        return torch.xpu.graph(graph, pool=pool, stream=stream)

    def replay_graph(self, graph) -> None:
        self._require_graphs()
        graph.replay()

    def report_facts(self) -> dict[str, Any] | None:
        """The device's facts when it is usable; otherwise what was decided about an installed IPEX."""
        if not self.probe().available:
            verdict = ipex_mod.inspect_ipex()
            return verdict.report_facts() if verdict.installed else None
        comm = self.comm_choice()
        ok, graphs = graph_support()
        return {
            **self.ipex_status().report_facts(),
            "communication_backend": comm.backend,
            "communication_reason": comm.reason,
            "graphs": graphs if ok else f"unsupported: {graphs}",
        }
