"""``zero_gpu.py --kernels``: the model-kernel rows (issue 46) and their report.

Rows it adds after each configuration's rows:

- ``polyaccel <config> kernels``: the same engine config plus ``"kernels"`` with all four kernels on
  (RMSNorm, RoPE, SwiGLU, the fused linear cross-entropy; docs/model-kernels.md);
- ``fsdp2+liger <config>``: FSDP2 (``zero_peers.fsdp2_step``) on a model given Liger's kernels first
  (``liger_kernel.transformers.apply_liger_kernel_to_llama``: RoPE, RMSNorm, SwiGLU and its fused linear
  cross-entropy), so that the comparison with FSDP2 stays honest: kernels against kernels. Skipped, with the
  reason, where ``liger_kernel`` is not importable. Liger patches Hugging Face's Llama classes process-wide,
  so ``--kernels`` with the fsdp2 peer needs ``--isolate`` (every row in its own process).

The report prints, per configuration: kernels / without (polyaccel), polyaccel with kernels / FSDP2 and / FSDP2
with Liger (targets: <= 0.85x FSDP2's step time at <= its memory for the 1B stage-3 row; <= 0.85x the torch
fused-AdamW baseline for the 220M stage-1 row), and whether the first losses agree (same weights, same batch).
"""

from __future__ import annotations

KERNELS = {"rms_norm": True, "rope": True, "swiglu": True, "cross_entropy": True}
LIGER = "fsdp2+liger"


def apply_liger(model) -> None:
    """Liger's four Llama kernels on ``model`` (RoPE, RMSNorm, SwiGLU, its fused linear cross-entropy); raises
    ImportError where ``liger_kernel`` is not installed."""
    from liger_kernel.transformers import apply_liger_kernel_to_llama

    apply_liger_kernel_to_llama(rope=True, rms_norm=True, swiglu=True, cross_entropy=False,
                                fused_linear_cross_entropy=True, model=model)


def liger_fsdp2_step(model, zero: dict, device, lr: float, wd: float):
    """FSDP2's step (``zero_peers.fsdp2_step``) on ``model`` after Liger's Llama kernels were applied to it."""
    from zero_peers import PeerUnavailable, fsdp2_step

    try:
        apply_liger(model)
    except ImportError as exc:
        raise PeerUnavailable(f"liger_kernel not importable ({exc})") from None
    return fsdp2_step(model, zero, device, lr, wd)


def _ratio(ours, theirs) -> str:
    if not (ours and theirs and theirs["step_ms"]):
        return ""
    memory = f"  memory {ours['peak_gib'] / theirs['peak_gib']:5.2f}" if theirs["peak_gib"] else ""
    first = "  first losses " + ("agree" if abs(ours["first_loss"] - theirs["first_loss"]) < 2e-2 else "DIFFER")
    return f"time {ours['step_ms'] / theirs['step_ms']:5.2f}{memory}{first}"


def report(by_name: dict, configs, baseline: str) -> None:
    print("\nmodel kernels (time / memory below 1: the kernels row faster / smaller)")
    base = by_name.get(baseline)
    for name, _ in configs:
        ours = by_name.get(f"polyaccel {name} kernels")
        if not ours:
            continue
        for label, theirs in (("/ polyaccel without", by_name.get(f"polyaccel {name}")),
                              ("/ fsdp2", by_name.get(f"fsdp2 {name}")),
                              (f"/ {LIGER}", by_name.get(f"{LIGER} {name}")),
                              ("/ torch baseline", base)):
            line = _ratio(ours, theirs)
            if line:
                print(f"{name + ' kernels':45s} {label:22s} {line}")


__all__ = ["KERNELS", "LIGER", "liger_fsdp2_step", "report"]
