"""cpu op builders: torch's fused CPU Adam kernel, foreach Lion/Lamb (no per-tensor Python).

The implementations are core's device-generic ``polyaccel.ops.torch_optim``; what is
cpu-specific is only that torch's CPU kernels are the fastest we have here (the fused
Adam kernel matches DeepSpeedCPUAdam's speed).
"""

from __future__ import annotations

from polyaccel.ops import OpBuilder, torch_optim


def builders() -> list[OpBuilder]:
    return [OpBuilder(op="fused_adam", name="cpu_fused_adam", device_types=("cpu",),
                      loader=lambda: torch_optim.fused_adam, kind="torch", priority=10,
                      description="torch's fused CPU Adam/AdamW kernel (foreach for mixed dtypes)"),
            *torch_optim.foreach_builders("cpu", priority=10, prefix="cpu_"),
            OpBuilder(op="rms_norm", name="cpu_rms_norm", device_types=("cpu",), loader=_model_op("rms_norm"),
                      kind="torch", priority=10,
                      description="torch closed form, one autograd node: saves x and rstd only, no squared temporary"),
            OpBuilder(op="rope", name="cpu_rope", device_types=("cpu",), loader=_model_op("rope"), kind="torch",
                      priority=10, description="torch closed form, one autograd node: addcmul_ into the output, "
                                               "backward from cos/sin alone"),
            OpBuilder(op="linear_cross_entropy", name="cpu_chunked_linear_cross_entropy", device_types=("cpu",),
                      loader=_chunked_linear_cross_entropy, kind="torch", priority=10,
                      description="torch, in chunks of tokens: one chunk's logits at a time, gradients in the "
                                  "forward (polyaccel.ops.chunked_loss)")]


def _chunked_linear_cross_entropy():
    from polyaccel.ops.chunked_loss import linear_cross_entropy

    return linear_cross_entropy


def _model_op(name: str):
    def load():
        from . import model_ops

        return getattr(model_ops, name)

    return load
