"""cpu op builders: torch's fused CPU Adam kernel, foreach Lion/Lamb (no per-tensor Python).

The implementations are core's device-generic ``polyaccel.ops.torch_optim``; what is
cpu-specific is only that torch's CPU kernels are the fastest we have here (the fused
Adam kernel matches DeepSpeedCPUAdam's speed).
"""

from __future__ import annotations

from polyaccel.ops import OpBuilder, torch_optim


def builders() -> list[OpBuilder]:
    return [
        OpBuilder(op=op, name=f"cpu_{op}", device_types=("cpu",), loader=lambda fn=fn: fn, kind="torch", priority=10,
                  description=what)
        for op, fn, what in (
            ("fused_adam", torch_optim.fused_adam, "torch's fused CPU Adam/AdamW kernel (foreach for mixed dtypes)"),
            ("fused_lion", torch_optim.fused_lion, "torch foreach ops"),
            ("fused_lamb", torch_optim.fused_lamb, "torch foreach ops, per-tensor trust ratios"),
        )
    ]
