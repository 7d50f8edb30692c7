"""The parts of :mod:`polyaccel.integrations.deepspeed` that need no DeepSpeed: the quiet ``import deepspeed``
:func:`~polyaccel.integrations.deepspeed.install` runs, and the op objects polyaccel's builders hand
DeepSpeed."""

from __future__ import annotations

import logging
import sys

import polyaccel
from polyaccel import ops as _ops

#: what ``import deepspeed`` logs when it finds no GPU and falls back to its CPU accelerator
FALLBACK_LINE = "Setting accelerator to CPU"


class _DropFallbackLine(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.getMessage()).startswith(FALLBACK_LINE)


def import_deepspeed_quietly():
    """``import deepspeed`` without its "Setting accelerator to CPU ..." warning: DeepSpeed picks an
    accelerator while it imports (and binds its op builders to it), and the integration exists to replace that
    choice with polyaccel's in ``install()``, so the line would only mislead. Every other record of
    DeepSpeed's logger passes, and a ``deepspeed`` imported earlier by the application is left as it is."""
    if "deepspeed" in sys.modules:
        return sys.modules["deepspeed"]
    ds_logger = logging.getLogger("DeepSpeed")  # the logger DeepSpeed's LoggerFactory configures on import
    quiet = _DropFallbackLine()
    ds_logger.addFilter(quiet)
    try:
        import deepspeed
    finally:
        ds_logger.removeFilter(quiet)
    return deepspeed


#: builders that run polyaccel ops; all others are NotImplementedBuilder
MAPPED_BUILDERS = ("FusedAdamBuilder", "FusedLionBuilder", "CPUAdamBuilder")


# ------------------------------------------------------------------------------------------- op modules
class FusedAdamOp:
    """What ``FusedAdamBuilder().load()`` returns: DeepSpeed's ``multi_tensor_adam`` over polyaccel's
    ``fused_adam``."""

    calls = 0  # optimizer steps run through polyaccel (all instances)

    @staticmethod
    def multi_tensor_adam(chunk_size, noop_flag, tensor_lists, lr, beta1, beta2, eps, step, adam_w_mode,
                          bias_correction, weight_decay):
        grads, params, exp_avgs, exp_avg_sqs = tensor_lists
        FusedAdamOp.calls += 1
        _ops.fused_adam(params, grads, exp_avgs, exp_avg_sqs, lr=lr, beta1=beta1, beta2=beta2, eps=eps,
                        weight_decay=weight_decay, step=step, adam_w_mode=bool(adam_w_mode),
                        bias_correction=bool(bias_correction))


class FusedLionOp:
    """What ``FusedLionBuilder().load()`` returns: ``multi_tensor_lion`` over polyaccel's ``fused_lion``."""

    calls = 0

    @staticmethod
    def multi_tensor_lion(chunk_size, noop_flag, tensor_lists, lr, beta1, beta2, step, weight_decay):
        grads, params, exp_avgs = tensor_lists
        FusedLionOp.calls += 1
        _ops.fused_lion(params, grads, exp_avgs, lr=lr, beta1=beta1, beta2=beta2, weight_decay=weight_decay)


class CPUAdamOp:
    """What ``CPUAdamBuilder().load()`` returns: DeepSpeed's per-optimizer CPU Adam API over
    ``fused_adam``."""

    calls = 0

    def __init__(self):
        self._optimizers: dict[int, dict] = {}

    def create_adam(self, optimizer_id, lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0,
                    adamw_mode=True, should_log=False):
        self._optimizers[optimizer_id] = {"adam_w_mode": bool(adamw_mode)}
        return 0

    def adam_update(self, optimizer_id, step, lr, beta1, beta2, eps, weight_decay, bias_correction, params,
                    grads, exp_avg, exp_avg_sq):
        opt = self._optimizers.get(optimizer_id)
        if opt is None:
            raise polyaccel.PolyaccelError(
                f"polyaccel CPUAdam: optimizer {optimizer_id} was never created (create_adam)")
        CPUAdamOp.calls += 1
        _ops.fused_adam([params], [grads], [exp_avg], [exp_avg_sq], lr=lr, beta1=beta1, beta2=beta2, eps=eps,
                        weight_decay=weight_decay, step=step, adam_w_mode=opt["adam_w_mode"],
                        bias_correction=bool(bias_correction))
        return 0

    def adam_rollback(self, *args, **kwargs):
        raise polyaccel.Unsupported(polyaccel.get_accelerator().name, "DeepSpeed's CPUAdam rollback",
                                    "DeepSpeed uses it for ZeRO-3 overflow handling of offloaded subgroups; "
                                    "disable fp16 or use bf16")

    def destroy_adam(self, optimizer_id):
        self._optimizers.pop(optimizer_id, None)
        return 0


for _cls in (FusedAdamOp, FusedLionOp, CPUAdamOp):
    _cls.__module__ = "polyaccel.integrations.deepspeed"  # their public home
