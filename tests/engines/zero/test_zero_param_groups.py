"""Per-parameter-group weight decay in the ZeRO engine (``param_groups=``): the same steps as torch's AdamW with
the same groups (float64, 10 steps) at stages 1, 2 and 3, offloaded, on 2 gloo ranks, with Lion and LAMB against
polyaccel's own optimizers with those groups; a bad group is refused naming itself, touching nothing."""

from __future__ import annotations

import copy

import pytest
import torch
from polyaccel.errors import ConfigError
from polyaccel.testing.multiprocess import run_ranks

pytestmark = pytest.mark.timeout(120)

F64 = torch.float64
STEPS = 10
LR = 2e-2


class Net(torch.nn.Module):
    """Weights, biases and norms interleaved in registration order, so decay runs alternate in every layout."""

    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Linear(6, 10)
        self.norm1 = torch.nn.LayerNorm(10)
        self.hidden = torch.nn.Linear(10, 9)
        self.norm2 = torch.nn.LayerNorm(9)
        self.head = torch.nn.Linear(9, 3)
        self.scale = torch.nn.Parameter(torch.randn(3))
        self.frozen = torch.nn.Parameter(torch.randn(3), requires_grad=False)

    def forward(self, x):
        h = torch.tanh(self.norm1(self.embed(x)))
        h = torch.tanh(self.norm2(self.hidden(h)))
        return (self.head(h) * self.scale + self.frozen).sin().square().mean()


def _net(seed: int = 0) -> Net:
    torch.manual_seed(seed)
    net = Net().double()
    with torch.no_grad():  # LayerNorm starts at ones/zeros: move it so a wrong decay shows at once
        for p in net.parameters():
            p.add_(torch.randn_like(p) * 0.3)
    return net


def _groups_by_name(net: torch.nn.Module) -> list[dict]:
    """Three decays: biases and norms none, the head its own, the rest (``embed.weight``, ``hidden.weight``)
    in no group (the config's 0.1)."""
    names = [n for n, p in net.named_parameters() if p.requires_grad]
    no_decay = [n for n in names if n.endswith("bias") or n.startswith("norm")]
    return [{"params": no_decay, "weight_decay": 0.0, "name": "no_decay"},
            {"params": ["head.weight", "scale"], "weight_decay": 0.03}]


def _torch_groups(net: torch.nn.Module, groups: list[dict], default: float) -> list[dict]:
    by_name = dict(net.named_parameters())
    listed = {n for g in groups for n in g["params"]}
    out = [{"params": [by_name[n] for n in g["params"]], "weight_decay": g["weight_decay"]} for g in groups]
    rest = [p for n, p in net.named_parameters() if p.requires_grad and n not in listed]
    return out + [{"params": rest, "weight_decay": default}]


def _batch(step: int, rank: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(100 * step + rank)
    return torch.randn(4, 6, generator=g, dtype=F64)


def _config(stage: int, opt: str = "adamw", offload: bool = False) -> dict:
    zero = {"stage": stage, "reduce_bucket_size": 16}  # small buckets: runs cross bucket ends (stages 1, 2)
    if stage == 3:
        zero["stage3_param_persistence_threshold"] = 0
    if offload:
        zero["offload_optimizer"] = {"device": "cpu"}
    params = {"lr": LR, "weight_decay": 0.1}
    if opt == "lion":
        params["betas"] = [0.9, 0.99]
    return {"optimizer": {"type": opt, "params": params}, "zero_optimization": zero}


def _reference(opt: str, world: int) -> dict[str, torch.Tensor]:
    from polyaccel.optim import FusedLamb, FusedLion

    net = _net()
    groups = _torch_groups(net, _groups_by_name(net), 0.1)
    if opt == "adamw":
        optim = torch.optim.AdamW(groups, lr=LR)
    elif opt == "lion":
        optim = FusedLion(groups, lr=LR, betas=(0.9, 0.99))
    else:
        optim = FusedLamb(groups, lr=LR, eps=1e-8)  # the engine's (DeepSpeed's) default eps
    for step in range(STEPS):
        net(torch.cat([_batch(step, r) for r in range(world)])).backward()
        optim.step()
        optim.zero_grad()
    return {n: p.detach().clone() for n, p in net.named_parameters()}


def _train(rank: int, stage: int, opt: str = "adamw", offload: bool = False, by: str = "name"):
    import polyaccel

    net = _net()
    groups = _groups_by_name(net)
    if by == "tensor":
        named = dict(net.named_parameters())
        groups = [{**g, "params": [named[n] for n in g["params"]]} for g in groups]
    engine = polyaccel.initialize(net, _config(stage, opt, offload), param_groups=groups)
    try:
        for step in range(STEPS):
            engine.backward(engine(_batch(step, rank)))
            assert engine.step()
        return {k: v.detach().clone() for k, v in engine.full_state_dict().items()}
    finally:
        engine.destroy()


def _assert_params(got: dict, ref: dict) -> None:
    for name, want in ref.items():
        torch.testing.assert_close(got[name], want, rtol=0, atol=1e-10, msg=lambda m, n=name: f"{n}: {m}")


@pytest.mark.parametrize("stage,offload,by", [(1, False, "name"), (2, False, "tensor"), (3, False, "name"),
                                              (2, True, "name"), (3, True, "tensor")])
def test_groups_equal_torch_adamw(stage, offload, by):
    _assert_params(_train(0, stage, offload=offload, by=by), _reference("adamw", 1))


@pytest.mark.parametrize("opt,stage", [("lion", 2), ("lamb", 1), ("lamb", 3)])
def test_groups_with_lion_and_lamb(opt, stage):
    _assert_params(_train(0, stage, opt), _reference(opt, 1))


def test_without_groups_one_decay_everywhere():
    """The config's decay alone (no param_groups) is still torch's AdamW with one group: groups are what differ."""
    import polyaccel

    net, ref = _net(), _net()
    engine = polyaccel.initialize(net, _config(2))
    optim = torch.optim.AdamW([p for p in ref.parameters() if p.requires_grad], lr=LR, weight_decay=0.1)
    try:
        assert engine.optimizer.uniform_decay == 0.1
        for step in range(3):
            engine.backward(engine(_batch(step, 0)))
            engine.step()
            ref(_batch(step, 0)).backward()
            optim.step()
            optim.zero_grad()
        _assert_params(engine.full_state_dict(), {n: p.detach() for n, p in ref.named_parameters()})
    finally:
        engine.destroy()


def two_rank_groups(rank: int, world: int) -> dict:
    torch.set_num_threads(1)
    return {stage: _train(rank, stage) for stage in (2, 3)}


def test_groups_on_two_gloo_ranks():
    """Each rank owns part of every run (stage 2: bucket slices; stage 3: a half of each parameter)."""
    ref = _reference("adamw", 2)
    for got in run_ranks(two_rank_groups, 2, timeout=90):
        for stage in (2, 3):
            _assert_params(got[stage], ref)


# ------------------------------------------------------------------------------------------- refusals
@pytest.mark.parametrize("groups,message", [
    ([{"params": ["nope.weight"], "weight_decay": 0.0}], "param_groups[0]: 'nope.weight' is not a parameter"),
    ([{"params": ["head.bias"]}, {"params": ["head.bias"], "name": "again"}],
     "parameter 'head.bias' is in param_groups[0] and in param_groups[1] ('again')"),
    ([{"params": ["head.bias"], "weight_decay": float("nan")}], "param_groups[0]: 'weight_decay' must be a finite"),
    ([{"params": ["head.bias"], "weight_decay": -0.1}], "'weight_decay' must be a finite number >= 0, got -0.1"),
    ([{"params": ["head.bias"], "weight_decay": True}], "'weight_decay' must be a finite number >= 0, got True"),
    ([{"params": ["head.bias"], "lr": 0.1, "name": "fast"}], "param_groups[0] ('fast'): unknown key(s) 'lr'"),
    ([{"weight_decay": 0.0}], "param_groups[0]: missing 'params'"),
    ([{"params": [torch.zeros(3, dtype=F64)]}], "params[0] (a tensor of shape (3,)) is not a parameter of the model"),
    ([{"params": [3]}], "param_groups[0]: params[0] must be a parameter of the model or its name, got int"),
    ({"params": ["head.bias"]}, "param_groups must be a list of dicts"),
    (["head.bias"], "param_groups[0] must be a dict"),
])
def test_bad_groups_are_refused_and_nothing_changes(groups, message):
    import polyaccel

    net = _net()
    before = {n: p.detach().clone() for n, p in net.named_parameters()}
    cfg = _config(2)
    cfg_before, groups_before = copy.deepcopy(cfg), copy.deepcopy(groups)
    with pytest.raises(ConfigError) as err:
        polyaccel.initialize(net, cfg, param_groups=groups)
    assert message in str(err.value) and "\n" not in str(err.value)
    assert cfg == cfg_before
    assert repr(groups) == repr(groups_before)
    for n, p in net.named_parameters():  # not moved, cast or rebound into a flat buffer
        assert torch.equal(p.detach(), before[n]) and p.dtype == F64


def test_groups_are_read_only():
    """The caller's groups and lists are left as they were; a frozen parameter in a group is allowed (it does
    not train); a group without weight_decay takes the config's."""
    import polyaccel

    net = _net()
    groups = [{"params": ("norm1.weight", "frozen"), "weight_decay": 0.0}, {"params": ["head.bias"]}]
    snapshot = copy.deepcopy(groups)
    engine = polyaccel.initialize(net, _config(1), param_groups=groups)
    try:
        assert groups == snapshot
        assert engine.weight_decays == {"norm1.weight": 0.0, "head.bias": 0.1}
    finally:
        engine.destroy()


@pytest.mark.parametrize("seed", range(4))
def test_param_ranges_agree_with_segment_ids(seed):
    """The runs come from each layout's parameter ranges: they cover the partition in order and name the same
    parameter as the per-element index (drawn shapes, zero-size parameters, worlds of 1-4, tiny buckets)."""
    import random

    from polyaccel.engines.zero.partition import FlatLayout, ShardLayout

    rnd = random.Random(seed)
    for _ in range(40):
        n = rnd.randint(1, 7)
        shapes = [(rnd.randint(0, 13),) for _ in range(n)]
        world = rnd.randint(1, 4)
        names = [f"p{i}" for i in range(n)]
        for layout in (FlatLayout(names, shapes, world, rnd.randint(1, 40)), ShardLayout(names, shapes, world)):
            for rank in range(world):
                ids = layout.segment_ids(rank)
                got, pos = torch.full_like(ids, -1), 0
                for lo, hi, i in layout.param_ranges(rank):
                    assert lo == pos < hi
                    got[lo:hi], pos = i, hi
                assert pos == ids.numel()
                real = ids < n  # stage 3: a shard's tail padding counts as its parameter's
                assert torch.equal(got[real], ids[real])
                if isinstance(layout, FlatLayout):
                    assert torch.equal(got, ids)
