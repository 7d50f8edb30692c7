"""One-process checks: config validation, partition layouts, loss scaler, host buffers, the entry point."""

from __future__ import annotations

import copy
import math

import pytest
import torch
from polyaccel.engines.zero.config import parse_config
from polyaccel.engines.zero.loss_scaler import LossScaler
from polyaccel.engines.zero.partition import FlatLayout, ShardLayout
from polyaccel.errors import ConfigError, Unsupported

FULL = {
    "train_batch_size": 16, "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 4,
    "gradient_clipping": 1.0, "bf16": {"enabled": True},
    "optimizer": {"type": "AdamW", "params": {"lr": 3e-4, "betas": [0.9, 0.95], "eps": 1e-8, "weight_decay": 0.1}},
    "zero_optimization": {"stage": 3, "reduce_bucket_size": 1000, "overlap_comm": True,
                          "contiguous_gradients": True, "stage3_prefetch_bucket_size": 500,
                          "stage3_param_persistence_threshold": 10, "offload_optimizer": {"device": "cpu"},
                          "offload_param": {"device": "cpu", "pin_memory": False}},
}


def test_full_config_parses_and_is_not_mutated():
    before = copy.deepcopy(FULL)
    cfg = parse_config(FULL, world_size=2)
    assert FULL == before
    assert cfg.stage == 3 and cfg.bf16 and cfg.gradient_accumulation_steps == 4
    assert cfg.optimizer.type == "adamw" and cfg.optimizer.betas == (0.9, 0.95) and cfg.optimizer.adam_w_mode
    assert cfg.offload_optimizer.enabled and cfg.offload_param.enabled and not cfg.offload_param.pin_memory
    cfg.raw["zero_optimization"]["stage"] = 1  # the kept copy is the engine's own
    assert FULL == before


@pytest.mark.parametrize("config, words", [
    ({"zero_optimisation": {}}, ["'zero_optimisation'", "zero_optimization"]),
    ({"zero_optimization": {"stage": 4}}, ["zero_optimization.stage", "1, 2, 3", "4"]),
    ({"zero_optimization": {"stage": 2, "bogus": 1}}, ["zero_optimization.bogus", "reduce_bucket_size"]),
    ({"zero_optimization": {"offload_optimizer": {"device": "nvme"}}},
     ["zero_optimization.offload_optimizer.device", "none, cpu", "nvme"]),
    ({"zero_optimization": {"stage": 2, "offload_param": {"device": "cpu"}}}, ["offload_param", "stage"]),
    ({"zero_optimization": {"reduce_bucket_size": 0}}, ["reduce_bucket_size", ">= 1"]),
    ({"optimizer": {"type": "sgd"}}, ["optimizer.type", "adam, adamw, lion, lamb", "sgd"]),
    ({"optimizer": {"type": "lion", "params": {"eps": 1e-8}}}, ["optimizer.params.eps", "betas"]),
    ({"optimizer": {"params": {"betas": [0.9, 1.5]}}}, ["optimizer.params.betas", "[0, 1)"]),
    ({"optimizer": {"params": {"lr": -1}}}, ["optimizer.params.lr", ">= 0"]),
    ({"bf16": {"enabled": True}, "fp16": {"enabled": True}}, ["bf16.enabled", "fp16.enabled"]),
    ({"bf16": {"enabled": "yes"}}, ["bf16.enabled", "true or false"]),
    ({"fp16": {"enabled": True, "min_loss_scale": 0}}, ["fp16.min_loss_scale", "> 0"]),
    ({"gradient_accumulation_steps": 0}, ["gradient_accumulation_steps", ">= 1"]),
    ({"gradient_clipping": float("nan")}, ["gradient_clipping", "finite"]),
    ({"train_batch_size": 10, "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2},
     ["train_batch_size", "(10)", "gradient_accumulation_steps (2)"]),
    ({"zero_optimization": "3"}, ["zero_optimization", "dict"]),
])
def test_bad_config_names_key_and_allowed_values(config, words):
    before = copy.deepcopy(config)
    with pytest.raises(ConfigError) as info:
        parse_config(config, world_size=2)
    for w in words:
        assert w in str(info.value), (w, str(info.value))
    assert config == before


def test_batch_size_keys_are_reconciled():
    cfg = parse_config({"train_batch_size": 16, "train_micro_batch_size_per_gpu": 2}, world_size=2)
    assert cfg.gradient_accumulation_steps == 4
    cfg = parse_config({"train_batch_size": 16, "gradient_accumulation_steps": 2}, world_size=2)
    assert cfg.train_micro_batch_size_per_gpu == 4
    assert parse_config(None).stage == 1 and parse_config({}).overlap_comm is False
    assert parse_config({"zero_optimization": {"stage": 3}}).overlap_comm is True  # DeepSpeed's default


@pytest.mark.parametrize("world", [1, 2, 3, 4])
@pytest.mark.parametrize("bucket", [1, 7, 64, 10_000])
def test_flat_layout_partitions_every_element_once(world, bucket):
    g = torch.Generator().manual_seed(world * 100 + bucket)
    shapes = [(3, 5), (0, 4), (1,), (7,), (2, 2, 3)]
    names = [f"p{i}" for i in range(len(shapes))]
    layout = FlatLayout(names, shapes, world, bucket)
    total = sum(math.prod(s) for s in shapes)
    assert layout.partition_size == math.ceil(total / world)
    flat = torch.randn(layout.padded_total, generator=g)
    flat[total:] = 0
    parts = [layout.partition_of(flat, r) for r in range(world)]
    assert all(p.numel() == layout.partition_size for p in parts)
    assert torch.equal(layout.full_from_partitions(parts), flat)
    # a bucket's reduce-scatter chunk for rank r is exactly rank r's slice of that bucket
    for b in layout.buckets:
        for r in range(world):
            start, n = layout.owned(b.index, r)
            assert torch.equal(flat[b.start:b.start + b.length].view(world, -1)[r], flat[start:start + n])
            assert torch.equal(parts[r][b.part_offset:b.part_offset + n], flat[start:start + n])
    tensors = layout.unflatten(flat)
    assert [tuple(t.shape) for t in tensors.values()] == shapes
    assert torch.equal(layout.flatten(tensors, flat.dtype), flat)
    ids = torch.cat([layout.segment_ids(r) for r in range(world)])
    assert int((ids < len(names)).sum()) == total


@pytest.mark.parametrize("world", [1, 2, 3])
def test_shard_layout_round_trip(world):
    shapes = [(3, 5), (0, 4), (1,), (7,)]
    names = [f"p{i}" for i in range(len(shapes))]
    layout = ShardLayout(names, shapes, world)
    assert layout.partition_size == sum(math.ceil(math.prod(s) / world) for s in shapes)
    g = torch.Generator().manual_seed(world)
    tensors = {n: torch.randn(s, generator=g) for n, s in zip(names, shapes, strict=True)}
    parts = [layout.partition_of(tensors, r, torch.float64) for r in range(world)]
    back = layout.unflatten_partitions(parts)
    for n in names:
        assert torch.equal(back[n], tensors[n].double())
    valid = sum(int((layout.segment_ids(r) < len(names)).sum()) for r in range(world))
    assert valid == sum(math.prod(s) for s in shapes)


def test_dynamic_loss_scaler_halves_and_grows():
    from polyaccel.engines.zero.config import Fp16Config

    s = LossScaler(Fp16Config(enabled=True, initial_scale_power=4, loss_scale_window=2, hysteresis=2,
                              min_loss_scale=2.0))
    s.update(True)
    assert s.scale == 16.0  # first overflow spends the hysteresis
    s.update(True)
    assert s.scale == 8.0
    s.update(False)
    s.update(False)
    assert s.scale == 16.0  # a clean window doubles
    for _ in range(10):
        s.update(True)
    assert s.scale == 2.0  # floor
    static = LossScaler(Fp16Config(enabled=True, loss_scale=128.0))
    static.update(True)
    assert static.scale == 128.0
    assert LossScaler(None).scale == 1.0


class _Registering:
    """A host-register-only accelerator stand-in: records what the engine asked of it."""

    def __init__(self):
        self.registered, self.unregistered = [], []

    def has(self, cap):
        return cap == "host_register"

    def register_host_memory(self, t):
        self.registered.append(t.data_ptr())
        return t

    def unregister_host_memory(self, t):
        self.unregistered.append(t.data_ptr())
        return True


def test_host_buffers_use_the_accelerator_contract(monkeypatch):
    from polyaccel.engines.zero.offload import HostBuffers

    def forbidden(*a, **k):
        raise AssertionError("the engine must not call Tensor.pin_memory directly")

    monkeypatch.setattr(torch.Tensor, "pin_memory", forbidden)
    acc = _Registering()
    host = HostBuffers(acc)
    a, b = host.empty(10, torch.float32), host.empty(0, torch.float32)
    assert host.how == "registered" and acc.registered == [a.data_ptr()] and b.numel() == 0
    host.release()
    assert acc.unregistered == [a.data_ptr()]
    assert HostBuffers(acc, pin=False).how == "pageable"


class _PinningAndRegistering(_Registering):
    """An accelerator stand-in that can both pin and register."""

    def __init__(self):
        super().__init__()
        self.pinned = []

    def has(self, cap):
        return cap in ("pinned", "host_register")

    def empty_pinned(self, shape, dtype):
        t = torch.empty(shape, dtype=dtype)
        self.pinned.append(t.data_ptr())
        return t


def test_large_host_buffers_are_registered_not_pinned():
    """A pinned allocation may be rounded up by the runtime (a power of two in torch's host allocator): from
    REGISTER_FROM_BYTES on, a buffer is allocated at its size and registered in place; smaller ones are pinned."""
    from polyaccel.engines.zero import offload

    acc = _PinningAndRegistering()
    host = offload.HostBuffers(acc)
    big_numel = offload.REGISTER_FROM_BYTES // 2 + 3  # bf16: just over the threshold, not a power of two
    small = host.empty(1000, torch.float32)
    big = host.empty(big_numel, torch.bfloat16)
    below = host.empty(offload.REGISTER_FROM_BYTES // 4 - 1, torch.float32)
    assert host.how == "pinned"
    assert acc.pinned == [small.data_ptr(), below.data_ptr()] and acc.registered == [big.data_ptr()]
    assert big.numel() == big_numel and big.dtype == torch.bfloat16
    assert big.untyped_storage().nbytes() == big_numel * 2
    host.release()
    assert acc.unregistered == [big.data_ptr()]


def _tiny():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Tanh(), torch.nn.Linear(5, 2)).double()


def test_initialize_in_one_process_trains_like_adamw():
    """No launcher: the engine sets up a world of one, trains like AdamW, and tears comm down on destroy."""
    import polyaccel
    from polyaccel import comm

    model = _tiny()
    ref = copy.deepcopy(model)
    opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.01)
    config = {"optimizer": {"type": "adamw", "params": {"lr": 1e-2, "weight_decay": 0.01}},
              "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0}}
    engine = polyaccel.initialize(model, config=config)
    try:
        assert engine.module is model and engine.optimizer_builder == "cpu_fused_adam"
        g = torch.Generator().manual_seed(1)
        for _ in range(3):
            x = torch.randn(4, 6, generator=g, dtype=torch.float64)
            loss = engine(x).square().mean()
            engine.backward(loss)
            assert engine.step() is True
            ref_loss = ref(x).square().mean()
            ref_loss.backward()
            opt.step()
            opt.zero_grad()
            assert loss.item() == pytest.approx(ref_loss.item(), rel=1e-12)
        assert engine.global_steps == 3 and engine.micro_steps == 3 and engine.loss_scale == 1.0
        full = engine.full_state_dict()
        for name, p in ref.named_parameters():
            torch.testing.assert_close(full[name], p, rtol=1e-12, atol=1e-12)
        assert all(p.numel() == 0 for p in model.parameters())  # stage 3: released between steps
    finally:
        engine.destroy()
    assert not comm.is_initialized()


def test_gradient_accumulation_steps_only_at_boundary():
    import polyaccel

    engine = polyaccel.initialize(_tiny(), {"gradient_accumulation_steps": 3, "zero_optimization": {"stage": 2}})
    try:
        stepped = []
        for _ in range(6):
            engine.backward(engine(torch.randn(2, 6, dtype=torch.float64)).sum())
            stepped.append(engine.step())
        assert stepped == [False, False, True, False, False, True] and engine.global_steps == 2
    finally:
        engine.destroy()


def test_unsupported_precision_names_the_plugin(monkeypatch):
    import polyaccel
    from polyaccel.plugins.cpu.accelerator import CpuAccelerator

    monkeypatch.setattr(CpuAccelerator, "capabilities", lambda self: frozenset({"rng", "fp64"}))
    with pytest.raises(Unsupported) as info:
        polyaccel.initialize(_tiny(), {"bf16": {"enabled": True}})
    assert "cpu" in str(info.value) and "bf16" in str(info.value)
    from polyaccel import comm

    comm.destroy()


def test_bad_client_state_and_model_are_rejected(tmp_path):
    import polyaccel
    from polyaccel.errors import PolyaccelError

    with pytest.raises(TypeError, match="torch.nn.Module"):
        polyaccel.initialize("not a model", {})
    engine = polyaccel.initialize(_tiny(), {})
    try:
        with pytest.raises(PolyaccelError, match="JSON"):
            engine.save_checkpoint(tmp_path, client_state={"t": torch.zeros(1)})
        with pytest.raises(PolyaccelError, match="nothing' is not a directory; pass the directory given to save"):
            engine.load_checkpoint(tmp_path / "nothing")
        with pytest.raises(PolyaccelError, match="the file 'latest' is missing"):
            engine.load_checkpoint(tmp_path)
    finally:
        engine.destroy()


class _WithUnused(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.used = _tiny()
        self.unused = torch.nn.Linear(3, 3).double()

    def forward(self, x):
        return self.used(x)


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_parameters_without_gradients_do_not_stall_reduction(stage):
    """A parameter backward never reaches leaves its bucket incomplete: it is reduced at the end."""
    import polyaccel

    model = _WithUnused()
    ref = copy.deepcopy(model.used)
    opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.0)
    config = {"optimizer": {"type": "adamw", "params": {"lr": 1e-2, "weight_decay": 0.0}},
              "zero_optimization": {"stage": stage, "reduce_bucket_size": 8,
                                    "stage3_param_persistence_threshold": 0}}
    before = {k: v.clone() for k, v in model.unused.state_dict().items()}
    engine = polyaccel.initialize(model, config)
    try:
        for i in range(2):
            x = torch.randn(3, 6, generator=torch.Generator().manual_seed(i), dtype=torch.float64)
            engine.backward(engine(x).square().mean())
            engine.step()
            ref(x).square().mean().backward()
            opt.step()
            opt.zero_grad()
        full = engine.full_state_dict()
        for name, p in ref.named_parameters():
            torch.testing.assert_close(full[f"used.{name}"], p, rtol=1e-12, atol=1e-12)
        for name, v in before.items():  # zero gradient, no decay: Adam leaves it where it was
            torch.testing.assert_close(full[f"unused.{name}"], v, rtol=0, atol=0)
    finally:
        engine.destroy()


def test_contiguous_gradients_false_is_refused():
    with pytest.raises(ConfigError, match="contiguous_gradients"):
        parse_config({"zero_optimization": {"contiguous_gradients": False}})


@pytest.mark.parametrize("stage", [2, 3])
def test_offload_registers_host_buffers_through_the_accelerator(monkeypatch, stage):
    """An accelerator that can register host memory gets every offload buffer registered, and released."""
    import polyaccel
    from polyaccel.plugins.cpu.accelerator import CpuAccelerator

    calls = {"register": [], "unregister": []}
    caps = CpuAccelerator.capabilities
    monkeypatch.setattr(CpuAccelerator, "capabilities", lambda self: caps(self) | {"host_register"})
    monkeypatch.setattr(CpuAccelerator, "_host_register", lambda self, ptr, n: calls["register"].append(ptr),
                        raising=False)
    monkeypatch.setattr(CpuAccelerator, "_host_unregister", lambda self, ptr: calls["unregister"].append(ptr),
                        raising=False)

    def forbidden(*a, **k):
        raise AssertionError("the engine must not call Tensor.pin_memory directly")

    monkeypatch.setattr(torch.Tensor, "pin_memory", forbidden)
    zero = {"stage": stage, "offload_optimizer": {"device": "cpu"}}
    if stage == 3:
        zero["offload_param"] = {"device": "cpu"}
    engine = polyaccel.initialize(_tiny(), {"zero_optimization": zero})
    try:
        engine.backward(engine(torch.randn(2, 6, dtype=torch.float64)).sum())
        assert engine.step()
        acc = engine.accelerator
        registered = acc.host_registrations()
        assert engine.partitioner.master.data_ptr() in registered
        for t in engine.optimizer.state.values():
            assert t.data_ptr() in registered
        assert len(calls["register"]) >= 4 + (stage == 3)
        if stage == 3:  # the parameters' host shards: views of one registered buffer
            homes = {i.shard.untyped_storage().data_ptr() for i in engine.partitioner.infos.values()}
            assert len(homes) == 1 and homes <= set(registered)
    finally:
        engine.destroy()
    assert sorted(calls["unregister"]) == sorted(calls["register"])
    assert engine.accelerator.host_registrations() == {}


def test_granularity_threshold_makes_decoder_layers_leaves():
    """The largest modules of at most ``stage3_module_granularity_threshold`` elements are gathered whole;
    a single linear layer is never a leaf of its own, and 0 turns the rule off."""
    transformers = pytest.importorskip("transformers")
    from polyaccel.engines.zero.leaves import find_leaf_modules

    cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=24, num_hidden_layers=3,
                                   num_attention_heads=2, num_key_value_heads=2)
    model = transformers.LlamaForCausalLM(cfg)
    layer = sum(p.numel() for p in model.model.layers[0].parameters())
    assert sorted(find_leaf_modules(model, (), layer)) == [f"model.layers.{i}" for i in range(3)]
    assert sorted(find_leaf_modules(model, (), layer - 1)) == [f"model.layers.{i}.{part}" for i in range(3)
                                                               for part in ("mlp", "self_attn")]
    assert find_leaf_modules(model, (), 0) == {}
    assert list(find_leaf_modules(model, (), 10**9)) == [""]  # all of it: one gather
