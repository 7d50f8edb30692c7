"""Fixtures of the AutoEP tests."""

from __future__ import annotations

import pytest
import torch
from graph_double import CPUWithGraphs


@pytest.fixture(autouse=True)
def _one_thread():
    """Tiny tensors: intra-op threads only add contention next to other test workers."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


class _MaskedGroupedMM(torch.autograd.Function):
    """grouped_mm with no host read: each row's expert found on the device, rows past the last offset zero; the
    weight gradient in the weight's own layout (as the cuda builder gives it, so autograd can adopt it as .grad)."""

    @staticmethod
    def forward(ctx, x, weight, offsets):
        E = weight.shape[0]
        expert = torch.searchsorted(offsets.to(torch.int64), torch.arange(x.shape[0]), right=True)
        inside = (expert < E).unsqueeze(1).to(x.dtype)
        ctx.save_for_backward(x, weight, expert, inside)
        return torch.bmm(x.unsqueeze(1), weight[expert.clamp(max=E - 1)]).squeeze(1) * inside

    @staticmethod
    def backward(ctx, grad_out):
        x, weight, expert, inside = ctx.saved_tensors
        E = weight.shape[0]
        go = grad_out * inside
        dx = torch.bmm(go.unsqueeze(1), weight[expert.clamp(max=E - 1)].transpose(1, 2)).squeeze(1)
        rows = x.unsqueeze(2) * go.unsqueeze(1)  # [T, K, N]
        dw = torch.zeros((E + 1, *weight.shape[1:]), dtype=weight.dtype).index_add_(0, expert, rows)[:E]
        return dx, torch.empty_like(weight).copy_(dw), None


def masked_grouped_mm(x, weight, offsets):
    from polyaccel.ops.reference.grouped_mm import check_grouped_mm_shapes

    check_grouped_mm_shapes(x, weight, offsets)
    return _MaskedGroupedMM.apply(x, weight, offsets)


@pytest.fixture
def graphs(monkeypatch):
    """Device graphs on the host, and capture-safe grouped_mm / gather_sum builders for the cpu device."""
    import polyaccel
    from polyaccel.engines.autoep import graphed
    from polyaccel.hookspecs import hookimpl
    from polyaccel.ops.reference.gather_sum import gather_sum_backward, gather_sum_forward, make_gather_sum

    unchecked_gather_sum = make_gather_sum(gather_sum_forward, gather_sum_backward)

    class CaptureSafe:
        POLYACCEL_API_VERSION = "1.0"

        @hookimpl
        def polyaccel_register_ops(self, registry):
            registry.register("grouped_mm", "masked_grouped_mm", ("cpu",), lambda: masked_grouped_mm, priority=99)
            registry.register("gather_sum", "unchecked_gather_sum", ("cpu",), lambda: unchecked_gather_sum,
                              priority=99)

    polyaccel.register_plugin("capture_safe", CaptureSafe())
    device = CPUWithGraphs()
    monkeypatch.setattr(graphed, "accelerator_for", lambda dev: device)
    return device
