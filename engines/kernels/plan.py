"""What the ``kernels`` layer did to a model: the printable plan it records (``polyaccel.parallel.get_plan(model,
"kernels")``)."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field


@dataclass
class KernelPlan:
    #: kernel -> on (after "auto" was decided), and why
    kernels: dict[str, bool] = field(default_factory=dict)
    why: dict[str, str] = field(default_factory=dict)
    #: module path -> what it now runs ("rms_norm", "rms_norm (1 + w)", "swiglu", "rope", "cross_entropy", ...)
    swapped: dict[str, str] = field(default_factory=dict)
    #: module path -> why a module that looked like one of the kernels' modules was left alone
    left: dict[str, str] = field(default_factory=dict)
    #: class name -> how many modules of it were left alone without looking like any kernel's module
    untouched: Counter = field(default_factory=Counter)
    #: modeling files whose apply_rotary_pos_emb now dispatches (outside swapped attention: the original)
    rotary_modules: list[str] = field(default_factory=list)

    def count(self, kind: str) -> int:
        return sum(1 for v in self.swapped.values() if v.split(" ")[0] == kind)

    def __str__(self) -> str:
        lines = ["kernels:"]
        for name, on in self.kernels.items():
            lines.append(f"  {name:<14} {'on ' if on else 'off'}  {self.count(name):>4} swapped  ({self.why[name]})")
        if self.swapped:
            lines.append("swapped:")
            lines += [f"  {path or '<model>'}: {what}" for path, what in self.swapped.items()]
        if self.left:
            lines.append("left alone:")
            lines += [f"  {path or '<model>'}: {why}" for path, why in self.left.items()]
        if self.untouched:
            lines.append("not a kernel's module: " + ", ".join(f"{c} x{n}" for c, n in sorted(self.untouched.items())))
        return "\n".join(lines)


__all__ = ["KernelPlan"]
