"""supa op builders: the kernels torch_supa_ext registers under ``torch.ops.deepspeed``.

``import torch_supa_ext.deepspeed`` registers DeepSpeed-compatible kernels. polyaccel uses
them where their math *is* polyaccel's op:

* ``fused_adam``: ``multi_tensor_adam`` (mode 1 = AdamW) over lists of one dtype; lists that
  mix dtypes (16-bit params, fp32 states) go to the reference.
* ``fused_lion``: ``multi_tensor_lion``, same rule.
* ``fused_lamb``: the per-tensor ``lamb`` kernel scales the step by ``lr*sqrt(bc2)/bc1`` and
  adds eps to ``sqrt(v)`` unscaled, which differs from polyaccel's LAMB when bias correction
  is on; it is used for ``bias_correction=False`` (where the two agree exactly, eps_mode 1)
  and the reference serves the rest.
* ``quantize`` is not routed to the extension: its ``quantize`` uses DeepSpeed's convention
  (``scale = 2**(b-1)/absmax``, reciprocal stored, clamp to ``2**(b-1)-1``), a different
  op from polyaccel's ``quantize`` (``absmax/(2**(b-1)-1)``); the reference serves it.

The kernels walk each operand as ``numel()`` consecutive elements from ``data_ptr()``:
entries with a non-contiguous operand run on contiguous copies that are written back
(:func:`polyaccel.ops.layout.stage`).

Without the extension the builders are incompatible and the registry picks the reference.
"""

from __future__ import annotations

import torch
from polyaccel.errors import OpError
from polyaccel.ops import OpBuilder, layout
from polyaccel.ops.reference import optimizers as ref_optim

#: elements per chunk handed to the multi-tensor kernels (DeepSpeed's default)
CHUNK_SIZE = 2048 * 32
#: DeepSpeed's kernels take (grads, params, states...): every list but the first is written
_WRITTEN_AFTER_GRADS = frozenset((1, 2, 3))
#: the lamb kernel's (param, exp_avg, exp_avg_sq, grad) as staged: all but the grad are written
_LAMB_WRITTEN = frozenset((0, 1, 2))


def _compatible_with(kernel: str):
    def check(acc) -> tuple[bool, str]:
        if acc is None or acc.name != "supa":
            return False, "needs the supa accelerator (torch_supa on a Biren host)"
        from . import runtime

        ops = runtime.deepspeed_ops()
        if ops is None or not hasattr(ops, kernel):
            return False, f"torch_supa_ext is not installed or registers no torch.ops.deepspeed.{kernel}"
        return True, ""

    return check


def _kernel(name: str):
    from . import runtime

    ops = runtime.deepspeed_ops()
    if ops is None or not hasattr(ops, name):
        raise OpError(f"torch.ops.deepspeed.{name} is not registered (import torch_supa_ext.deepspeed)")
    return getattr(ops, name)


def _step_int(step) -> int:
    return int(step.item()) if isinstance(step, torch.Tensor) else int(step)


def _split_uniform(*lists):
    """Indices whose tensors share one 32/16-bit dtype across all lists (kernel-able), and the rest.

    float64 entries go to the reference: DeepSpeed's kernels do their math in fp32, the op's
    contract keeps float64 math for float64 tensors.
    """
    uniform, mixed = [], []
    for i, group in enumerate(zip(*lists, strict=True)):
        if group[0].numel() == 0:
            continue
        dtype = group[0].dtype
        (uniform if dtype != torch.float64 and all(t.dtype == dtype for t in group) else mixed).append(i)
    return uniform, mixed


def _pick(lst, idx):
    return [lst[i] for i in idx]


def make_fused_adam():
    kernel = _kernel("multi_tensor_adam")

    def fused_adam(params, grads, exp_avgs, exp_avg_sqs, *, lr, beta1, beta2, eps, weight_decay, step,
                   adam_w_mode=True, bias_correction=True):
        ref_optim.check_lists("fused_adam", params, grads, exp_avgs, exp_avg_sqs)
        uniform, mixed = _split_uniform(params, grads, exp_avgs, exp_avg_sqs)
        if uniform:
            noop = torch.zeros(1, dtype=torch.int32, device=params[uniform[0]].device)
            by_dtype: dict[torch.dtype, list[int]] = {}
            for i in uniform:
                by_dtype.setdefault(params[i].dtype, []).append(i)
            for idx in by_dtype.values():
                # (grads, params, exp_avgs, exp_avg_sqs): the kernel walks flat memory, so stage other layouts
                staged = layout.stage((_pick(grads, idx), _pick(params, idx), _pick(exp_avgs, idx),
                                       _pick(exp_avg_sqs, idx)), _WRITTEN_AFTER_GRADS, layout.all_contiguous)
                kernel(CHUNK_SIZE, noop, *staged.lists, lr, beta1, beta2, eps, _step_int(step),
                       1 if adam_w_mode else 0, bool(bias_correction), weight_decay)
                staged.copy_back()
        if mixed:
            ref_optim.fused_adam(_pick(params, mixed), _pick(grads, mixed), _pick(exp_avgs, mixed),
                                 _pick(exp_avg_sqs, mixed), lr=lr, beta1=beta1, beta2=beta2, eps=eps,
                                 weight_decay=weight_decay, step=step, adam_w_mode=adam_w_mode,
                                 bias_correction=bias_correction)

    return fused_adam


def make_fused_lion():
    kernel = _kernel("multi_tensor_lion")

    def fused_lion(params, grads, exp_avgs, *, lr, beta1, beta2, weight_decay):
        ref_optim.check_lists("fused_lion", params, grads, exp_avgs)
        uniform, mixed = _split_uniform(params, grads, exp_avgs)
        by_dtype: dict[torch.dtype, list[int]] = {}
        for i in uniform:
            by_dtype.setdefault(params[i].dtype, []).append(i)
        for idx in by_dtype.values():
            noop = torch.zeros(1, dtype=torch.int32, device=params[idx[0]].device)
            staged = layout.stage((_pick(grads, idx), _pick(params, idx), _pick(exp_avgs, idx)),
                                  _WRITTEN_AFTER_GRADS, layout.all_contiguous)
            kernel(CHUNK_SIZE, noop, *staged.lists, lr, beta1, beta2, 1, weight_decay)
            staged.copy_back()
        if mixed:
            ref_optim.fused_lion(_pick(params, mixed), _pick(grads, mixed), _pick(exp_avgs, mixed), lr=lr,
                                 beta1=beta1, beta2=beta2, weight_decay=weight_decay)

    return fused_lion


def make_fused_lamb():
    kernel = _kernel("lamb")

    def fused_lamb(params, grads, exp_avgs, exp_avg_sqs, *, lr, beta1, beta2, eps, weight_decay, step,
                   bias_correction=True, max_coeff=10.0, min_coeff=0.01):
        ref_optim.check_lists("fused_lamb", params, grads, exp_avgs, exp_avg_sqs)
        if bias_correction:
            # the kernel's bias correction differs from polyaccel's LAMB (see the module docstring)
            ref_optim.fused_lamb(params, grads, exp_avgs, exp_avg_sqs, lr=lr, beta1=beta1, beta2=beta2, eps=eps,
                                 weight_decay=weight_decay, step=step, bias_correction=True,
                                 max_coeff=max_coeff, min_coeff=min_coeff)
            return
        uniform, mixed = _split_uniform(params, grads, exp_avgs, exp_avg_sqs)
        for i in uniform:
            empty = torch.empty(0, dtype=params[i].dtype, device=params[i].device)
            staged = layout.stage(([params[i]], [exp_avgs[i]], [exp_avg_sqs[i]], [grads[i]]), _LAMB_WRITTEN,
                                  layout.all_contiguous)
            p, m, v, g = (lst[0] for lst in staged.lists)
            kernel(p, empty, m, v, g, lr, beta1, beta2, max_coeff, min_coeff, eps, 1.0, _step_int(step), 1, False,
                   weight_decay)
            staged.copy_back()
        if mixed:
            ref_optim.fused_lamb(_pick(params, mixed), _pick(grads, mixed), _pick(exp_avgs, mixed),
                                 _pick(exp_avg_sqs, mixed), lr=lr, beta1=beta1, beta2=beta2, eps=eps,
                                 weight_decay=weight_decay, step=step, bias_correction=False,
                                 max_coeff=max_coeff, min_coeff=min_coeff)

    return fused_lamb


def builders() -> list[OpBuilder]:
    return [
        OpBuilder(op=op, name=f"supa_ext_{op}", device_types=("supa",), loader=loader, kind="vendor", priority=50,
                  compatible=_compatible_with(kernel), description=what)
        for op, loader, kernel, what in (
            ("fused_adam", make_fused_adam, "multi_tensor_adam",
             "torch.ops.deepspeed.multi_tensor_adam (torch_supa_ext); mixed dtypes: reference"),
            ("fused_lion", make_fused_lion, "multi_tensor_lion",
             "torch.ops.deepspeed.multi_tensor_lion (torch_supa_ext); mixed dtypes: reference"),
            ("fused_lamb", make_fused_lamb, "lamb",
             "torch.ops.deepspeed.lamb (torch_supa_ext) without bias correction; otherwise reference"),
        )
    ]
