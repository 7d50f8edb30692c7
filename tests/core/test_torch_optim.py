"""torch_optim.fused_adam with a 16-bit gradient and a wider master: torch's fused kernel on upcast pieces."""

from __future__ import annotations

import pytest
import torch
from polyaccel.ops import reference as ref
from polyaccel.ops import torch_optim

HYPER = dict(lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01, step=3)


def _state(n, master, grad, seed):
    gen = torch.Generator().manual_seed(seed)
    p = torch.randn(n, generator=gen).to(master)
    g = torch.randn(n, generator=gen).to(grad)
    m = (torch.randn(n, generator=gen) * 0.1).to(master)
    v = (torch.rand(n, generator=gen) * 0.01).to(master)
    return p, g, m, v


@pytest.mark.parametrize("master,grad", [(torch.float32, torch.bfloat16), (torch.float32, torch.float16),
                                         (torch.float64, torch.float32)])
@pytest.mark.parametrize("adam_w_mode", [True, False])
def test_a_narrower_gradient_runs_the_fused_kernel_on_upcast_pieces(monkeypatch, master, grad, adam_w_mode):
    monkeypatch.setattr(torch_optim, "UPCAST_PIECE", 1000)  # 2 full pieces and a ragged one
    pieces = []
    real = torch_optim._fused_on_upcast_pieces
    monkeypatch.setattr(torch_optim, "_fused_on_upcast_pieces", lambda *a: pieces.append(1) or real(*a))
    p, g, m, v = _state(2345, master, grad, seed=1)
    want = [t.double() for t in (p, m, v)]
    ref.fused_adam([want[0]], [g.double()], [want[1]], [want[2]], adam_w_mode=adam_w_mode, bias_correction=True,
                   **HYPER)
    kernel = [t.clone() for t in (p, m, v)]  # the fused kernel on the whole gradient upcast at once
    (torch._fused_adamw_ if adam_w_mode else torch._fused_adam_)(
        [kernel[0]], [g.to(master)], [kernel[1]], [kernel[2]], [], [torch.tensor(3.0)], lr=HYPER["lr"],
        beta1=0.9, beta2=0.999, weight_decay=0.01, eps=1e-8, amsgrad=False, maximize=False)
    torch_optim.fused_adam([p], [g], [m], [v], adam_w_mode=adam_w_mode, bias_correction=True, **HYPER)
    assert pieces == [1]
    for got, k, w, name in zip((p, m, v), kernel, want, ("param", "exp_avg", "exp_avg_sq"), strict=True):
        assert torch.equal(got, k), f"{name}: differs from the fused kernel on the upcast gradient"
        tol = 1e-12 if master == torch.float64 else 2e-6
        torch.testing.assert_close(got.double(), w, rtol=tol, atol=tol, msg=name)


def test_a_strided_narrow_gradient_takes_the_foreach_path(monkeypatch):
    monkeypatch.setattr(torch_optim, "_fused_on_upcast_pieces", lambda *a: pytest.fail("strided: no pieces"))
    p, g, m, v = _state(600, torch.float32, torch.bfloat16, seed=2)
    g = torch.stack([g, g], dim=1)[:, 0]  # every other element
    want = [t.double() for t in (p, m, v)]
    ref.fused_adam([want[0]], [g.double()], [want[1]], [want[2]], adam_w_mode=True, bias_correction=True, **HYPER)
    torch_optim.fused_adam([p], [g], [m], [v], adam_w_mode=True, bias_correction=True, **HYPER)
    for got, w in zip((p, m, v), want, strict=True):
        torch.testing.assert_close(got.double(), w, rtol=2e-6, atol=2e-6)


def test_an_int_step_is_filled_in_on_the_device_not_copied_from_the_host():
    """A copy of a host tensor to an accelerator first waits for the device's queued work: the step count (an int
    every optimizer step) must reach the fused kernel as a fill. Seen at the dispatcher on the meta device."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Ops(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.seen = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.seen.append(str(func.overloadpacket))
            return func(*args, **(kwargs or {}))

    with Ops() as ops:
        step = torch_optim._step_tensor(7, torch.device("meta"))
    assert step.shape == () and step.dtype == torch.float32 and step.device.type == "meta"
    assert ops.seen == ["aten.full"], ops.seen  # (torch.tensor(..., device=) builds on the host, unseen here)
    assert float(torch_optim._step_tensor(7, torch.device("cpu"))) == 7.0
