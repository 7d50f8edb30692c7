"""Stage 3 with ``engine.checkpoint`` around a module whose submodules have their own gathers.

The recomputation runs in backward, after the backward fetch of the region's last submodule has
gathered it, and that submodule's forward hook runs again; its parameter must stay gathered until
autograd has accumulated its gradient (which it does into the parameter as it then is).
"""

from __future__ import annotations

import torch


class Residual(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.up = torch.nn.Linear(6, 10)
        self.down = torch.nn.Linear(10, 6)

    def forward(self, h):
        return h + self.down(torch.tanh(self.up(h)))


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.inp = torch.nn.Linear(4, 6)
        self.body = Residual()
        self.out = torch.nn.Linear(6, 3)
        self.checkpoint = None

    def forward(self, x):
        h = self.inp(x)
        h = self.checkpoint(self.body, h) if self.checkpoint is not None else self.body(h)
        return self.out(h).square().mean()


def test_checkpointed_module_with_gathered_submodules_trains_like_plain_torch():
    import polyaccel

    torch.manual_seed(0)
    ref = Net().double()
    model = Net().double()
    model.load_state_dict(ref.state_dict())
    engine = polyaccel.initialize(model, {
        "optimizer": {"type": "adamw", "params": {"lr": 1e-2, "weight_decay": 0.01}},
        "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
        "activation_checkpointing": {}})
    model.checkpoint = engine.checkpoint
    opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.01)
    for step in range(4):
        x = torch.randn(5, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(step))
        loss = engine(x)
        engine.backward(loss)
        engine.step()
        expected = ref(x)
        expected.backward()
        opt.step()
        opt.zero_grad()
        assert abs(loss.item() - expected.item()) <= 1e-12, step
    assert engine.checkpoint.checkpoints == 4
    got = engine.full_state_dict()
    for name, p in ref.named_parameters():
        torch.testing.assert_close(got[name], p.detach(), rtol=0, atol=1e-12)
    engine.destroy()
