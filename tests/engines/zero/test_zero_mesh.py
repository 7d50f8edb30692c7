"""ZeRO over a data x tensor mesh, driven only by :mod:`polyaccel.parallel` layouts.

A hand-written tensor-parallel MLP (column-split up projection with an uneven, two-section
split; row-split down projection; a replicated per-head scale whose gradients are partial
over the tensor ranks; replicated norm and head) on 4 ranks = data 2 x tensor 2, ZeRO stages
1-3: 10 AdamW steps with clipping equal single-process training of the unsplit model
(float64), and the reported gradient norm counts every element once.
"""

from __future__ import annotations

import pytest
import torch
from polyaccel.testing.multiprocess import run_ranks

pytestmark = pytest.mark.timeout(300)

VOCAB, HIDDEN, HEAD_DIM, HEADS, SEQ, MICRO, STEPS = 23, 8, 2, 3, 5, 2, 10
SECTIONS = ((2, 1), (2, 1))  # the up projection is [gate | up], 3 heads each: 2 heads on tensor rank 0, 1 on rank 1


class MLP(torch.nn.Module):
    """``down(silu(gate) * up * scale) + bias``; with ``tp`` set, the tensor-parallel version of it."""

    def __init__(self):
        super().__init__()
        self.up = torch.nn.Linear(HIDDEN, 2 * HEADS * HEAD_DIM)
        self.scale = torch.nn.Parameter(1 + 0.1 * torch.randn(HEAD_DIM))
        self.down_weight = torch.nn.Parameter(torch.randn(HIDDEN, HEADS * HEAD_DIM) / 3)
        self.down_bias = torch.nn.Parameter(0.1 * torch.randn(HIDDEN))
        self.tp = None  # (copy_in, sum_out) autograd functions over the tensor group

    def forward(self, h):
        if self.tp is not None:
            h = self.tp[0].apply(h)
        gate, up = self.up(h).chunk(2, dim=-1)
        x = torch.nn.functional.silu(gate) * up
        x = (x.unflatten(-1, (-1, HEAD_DIM)) * self.scale).flatten(-2)
        out = torch.nn.functional.linear(x, self.down_weight)
        if self.tp is not None:
            out = self.tp[1].apply(out)
        return out + self.down_bias


class Full(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.embed = torch.nn.Embedding(VOCAB, HIDDEN)
        self.mlp = MLP()
        self.norm = torch.nn.LayerNorm(HIDDEN)
        self.head = torch.nn.Linear(HIDDEN, VOCAB, bias=False)

    def forward(self, ids):
        h = self.embed(ids)
        h = h + self.mlp(h)
        logits = self.head(self.norm(h))
        return torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, VOCAB), ids[:, 1:].reshape(-1))


def split_model(model: Full, mesh):
    """Shard ``model`` in place over the mesh's tensor dimension and describe every parameter's layout."""
    from polyaccel import comm
    from polyaccel.parallel import ParamLayout, Split, set_layout

    group, r = mesh.group("tensor"), mesh.rank("tensor")

    class CopyIn(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x.view_as(x)

        @staticmethod
        def backward(ctx, g):
            g = g.clone()
            comm.all_reduce(g, group=group)
            return g

    class SumOut(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            x = x.clone()
            comm.all_reduce(x, group=group)
            return x

        @staticmethod
        def backward(ctx, g):
            return g

    rows = Split("tensor", 0, tuple(tuple(HEAD_DIM * n for n in s) for s in SECTIONS), r)
    cols = Split("tensor", 1, (tuple(HEAD_DIM * n for n in SECTIONS[0]),), r)
    mlp = model.mlp
    with torch.no_grad():
        up_w = torch.nn.Parameter(rows.piece(mlp.up.weight).clone())
        up_b = torch.nn.Parameter(rows.piece(mlp.up.bias).clone())
        down_w = torch.nn.Parameter(cols.piece(mlp.down_weight).clone())
    mlp.up.weight, mlp.up.bias, mlp.down_weight = up_w, up_b, down_w
    set_layout(up_w, ParamLayout(split=rows))
    set_layout(up_b, ParamLayout(split=rows))
    set_layout(down_w, ParamLayout(split=cols))
    set_layout(mlp.scale, ParamLayout(grad_sum="tensor"))
    mlp.tp = (CopyIn, SumOut)
    return {"mlp.up.weight": rows, "mlp.up.bias": rows, "mlp.down_weight": cols}


def batch(step: int, data_rank: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(50 * step + data_rank)
    return torch.randint(0, VOCAB, (MICRO, SEQ), generator=g)


def reference(data: int):
    model = Full().double()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)
    losses, norms = [], []
    for step in range(STEPS):
        loss = sum(model(batch(step, d)) for d in range(data)) / data
        loss.backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)))
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, norms, {k: v.detach().clone() for k, v in model.state_dict().items()}


def train(rank: int, world: int, stages: list[int]):
    from polyaccel import comm
    from polyaccel.comm.mesh import init_parallel_mesh
    from polyaccel.engines.zero import ZeroEngine

    torch.set_num_threads(1)
    mesh = init_parallel_mesh(tensor=2)
    out = {}
    for stage in stages:
        model = Full().double()
        splits = split_model(model, mesh)
        zero = {"stage": stage, "reduce_bucket_size": 60}
        if stage == 3:
            zero.update(stage3_param_persistence_threshold=0)
        cfg = {"optimizer": {"type": "adamw", "params": {"lr": 1e-2, "weight_decay": 0.01}},
               "zero_optimization": zero, "gradient_clipping": 0.5}
        engine = ZeroEngine(model, cfg, mesh=mesh)
        losses, norms = [], []
        for step in range(STEPS):
            loss = engine(batch(step, mesh.rank("data")))
            engine.backward(loss)
            engine.step()
            t = torch.tensor([loss.item()], dtype=torch.float64)
            comm.all_reduce(t)
            losses.append(t.item() / world)
            norms.append(engine.last_grad_norm)
        local = engine.full_state_dict()
        out[stage] = {"losses": losses, "norms": norms, "params": local, "tensor_rank": mesh.rank("tensor"),
                      "splits": splits, "groups": len(engine.groups)}
        engine.destroy()
    return out


def test_zero_stages_over_data_and_tensor_match_single_process_training():
    stages = [1, 2, 3]
    results = run_ranks(train, 4, stages, timeout=280)
    ref_losses, ref_norms, ref_params = reference(2)
    for stage in stages:
        got = [results[r][stage] for r in range(4)]
        assert got[0]["groups"] == 3, "dense, tensor-split and grad-summed parameters are separate groups"
        for step in range(STEPS):
            assert abs(got[0]["losses"][step] - ref_losses[step]) <= 1e-10, (stage, step)
            for r in range(4):
                assert abs(got[r]["norms"][step] - ref_norms[step]) <= 1e-9 * ref_norms[step], (stage, step, r)
        by_tensor = {g["tensor_rank"]: g for g in got}
        for name, ref in ref_params.items():
            split = got[0]["splits"].get(name)
            if split is None:
                for r in range(4):
                    err = (got[r]["params"][name] - ref).abs().max().item()
                    assert err <= 1e-10, f"stage {stage}: {name} on rank {r} off by {err:.3g}"
            else:
                full = split.assemble([by_tensor[t]["params"][name] for t in range(2)])
                err = (full - ref).abs().max().item()
                assert err <= 1e-10, f"stage {stage}: {name} assembled from the tensor ranks off by {err:.3g}"


def _engine(stage: int, mesh, split: bool):
    from polyaccel.engines.zero import ZeroEngine

    model = Full().double()
    if split:
        split_model(model, mesh)
    zero = {"stage": stage, "reduce_bucket_size": 60}
    if stage == 3:
        zero.update(stage3_param_persistence_threshold=0)
    cfg = {"optimizer": {"type": "adamw", "params": {"lr": 1e-2, "weight_decay": 0.01}},
           "zero_optimization": zero, "gradient_clipping": 0.5}
    return ZeroEngine(model, cfg, mesh=mesh if split else None)


def _steps(engine, start: int, n: int, data_rank: int, world: int) -> list[float]:
    from polyaccel import comm

    losses = []
    for step in range(start, start + n):
        loss = engine(batch(step, data_rank))
        engine.backward(loss)
        engine.step()
        t = torch.tensor([loss.item()], dtype=torch.float64)
        comm.all_reduce(t)
        losses.append(t.item() / world)
    return losses


def save_then_continue(rank: int, world: int, ckpt: str):
    from polyaccel.comm.mesh import init_parallel_mesh

    torch.set_num_threads(1)
    mesh = init_parallel_mesh(tensor=2)
    engine = _engine(2, mesh, split=True)
    _steps(engine, 0, 5, mesh.rank("data"), world)
    engine.save_checkpoint(ckpt)
    out = {"after": _steps(engine, 5, 3, mesh.rank("data"), world)}
    engine.destroy()
    # the same checkpoint into stage 3 at the same mesh
    engine = _engine(3, mesh, split=True)
    engine.load_checkpoint(ckpt)
    out["stage3_after"] = _steps(engine, 5, 3, mesh.rank("data"), world)
    engine.destroy()
    return out


def load_without_tensor_parallelism(rank: int, world: int, ckpt: str):
    torch.set_num_threads(1)
    engine = _engine(1, None, split=False)
    engine.load_checkpoint(ckpt)
    out = {"steps": engine.global_steps}
    out["after"] = _steps(engine, 5, 3, rank, world)
    engine.destroy()
    return out


def test_checkpoint_saved_split_over_tensor_ranks_loads_anywhere_and_consolidates(tmp_path):
    from polyaccel.engines.zero.consolidate import consolidate

    ckpt = str(tmp_path / "ckpt")
    first = run_ranks(save_then_continue, 4, ckpt, timeout=200)
    ref_losses, _, _ = reference(2)
    assert all(abs(a - b) <= 1e-10 for a, b in zip(first[0]["after"], ref_losses[5:8], strict=True))
    assert all(abs(a - b) <= 1e-10 for a, b in zip(first[0]["stage3_after"], ref_losses[5:8], strict=True))
    plain = run_ranks(load_without_tensor_parallelism, 2, ckpt, timeout=120)
    assert plain[0]["steps"] == 5
    assert all(abs(a - b) <= 1e-10 for a, b in zip(plain[0]["after"], ref_losses[5:8], strict=True))
    # offline: the full, unsplit state dict of the model at step 5
    model = Full().double()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)
    for step in range(5):
        (sum(model(batch(step, d)) for d in range(2)) / 2).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
        opt.step()
        opt.zero_grad()
    state = consolidate(ckpt)
    assert set(state) == set(model.state_dict())
    for name, ref in model.state_dict().items():
        assert state[name].shape == ref.shape, name
        assert (state[name] - ref).abs().max().item() <= 1e-10, name
