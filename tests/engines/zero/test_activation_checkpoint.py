"""Activation checkpointing, with and without the checkpointed inputs kept in host memory."""

from __future__ import annotations

import copy
import gc
import weakref

import pytest
import torch

pytestmark = pytest.mark.timeout(120)


def _checkpointer(**section):
    import polyaccel
    from polyaccel.engines.zero.activation_checkpoint import ActivationCheckpointer, parse_activation_checkpointing
    from polyaccel.engines.zero.offload import HostBuffers

    acc = polyaccel.get_accelerator()
    return ActivationCheckpointer(parse_activation_checkpointing(section), acc, HostBuffers(acc))


class Block(torch.nn.Module):
    def __init__(self, width):
        super().__init__()
        self.a = torch.nn.Linear(width, 2 * width)
        self.b = torch.nn.Linear(2 * width, width)
        self.drop = torch.nn.Dropout(0.3)

    def forward(self, x, scale=1.0):
        return x + scale * self.b(self.drop(torch.tanh(self.a(x))))


def _blocks(seed=0, n=4, width=8):
    torch.manual_seed(seed)
    return torch.nn.ModuleList(Block(width) for _ in range(n)).double()


def _run(blocks, x, wrap):
    torch.manual_seed(123)  # the dropout masks
    h = x
    for blk in blocks:
        h = wrap(blk, h)
    loss = h.square().sum()
    loss.backward()
    return loss.detach(), [p.grad.clone() for p in blocks.parameters()], x.grad.clone()


@pytest.mark.parametrize("cpu_checkpointing", [False, True])
def test_gradients_equal_plain_and_torch_checkpointing(cpu_checkpointing):
    from torch.utils.checkpoint import checkpoint as torch_checkpoint

    ours = _checkpointer(cpu_checkpointing=cpu_checkpointing)
    x0 = torch.randn(5, 8, dtype=torch.float64)
    results = []
    for wrap in (lambda blk, h: blk(h, scale=0.5),
                 lambda blk, h: torch_checkpoint(blk, h, scale=0.5, use_reentrant=False),
                 lambda blk, h: ours(blk, h, scale=0.5)):
        x = x0.clone().requires_grad_(True)
        results.append(_run(_blocks(), x, wrap))
    plain = results[0]
    for other in results[1:]:
        torch.testing.assert_close(other[0], plain[0], rtol=1e-12, atol=0)
        for a, b in zip(other[1], plain[1], strict=True):
            torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(other[2], plain[2], rtol=1e-12, atol=1e-12)
    assert plain[2].abs().sum() > 0


def test_dropout_masks_are_replayed_not_redrawn():
    """The recomputation sees the forward's random numbers: gradients equal the plain run's, which they would
    not if the second forward drew new dropout masks."""
    ours = _checkpointer(cpu_checkpointing=True)
    x0 = torch.randn(5, 8, dtype=torch.float64)
    plain = _run(_blocks(), x0.clone().requires_grad_(True), lambda blk, h: blk(h))

    def redraw(blk, h):  # a deliberately wrong checkpoint: recomputes with fresh randomness
        return torch.utils.checkpoint.checkpoint(blk, h, use_reentrant=False, preserve_rng_state=False)

    wrong = _run(_blocks(), x0.clone().requires_grad_(True), redraw)
    right = _run(_blocks(), x0.clone().requires_grad_(True), ours)
    assert not torch.allclose(wrong[1][0], plain[1][0])
    torch.testing.assert_close(right[1][0], plain[1][0], rtol=1e-12, atol=1e-12)


def test_cpu_checkpointing_lets_the_input_go():
    """Plain non-reentrant checkpointing keeps each input alive for the recomputation; with cpu_checkpointing
    only the host copy is kept, so the caller's tensor is freed as soon as the caller drops it."""
    from torch.utils.checkpoint import checkpoint as torch_checkpoint

    blk = _blocks(n=1)[0]
    ours = _checkpointer(cpu_checkpointing=True)
    for wrap, freed in ((lambda h: torch_checkpoint(blk, h, use_reentrant=False), False),
                        (lambda h: ours(blk, h), True)):
        x = torch.randn(5, 8, dtype=torch.float64, requires_grad=True)
        h = x * 2  # an intermediate, as a layer's input is
        ref = weakref.ref(h)
        out = wrap(h)
        del h
        gc.collect()
        assert (ref() is None) == freed
        out.sum().backward()
        assert x.grad is not None and x.grad.abs().sum() > 0


def test_host_buffers_are_reused_between_steps():
    ours = _checkpointer(cpu_checkpointing=True)
    blocks = _blocks()
    made = []
    original = ours.offload.host.empty
    ours.offload.host.empty = lambda n, dtype: made.append(n) or original(n, dtype)
    for _ in range(3):
        x = torch.randn(5, 8, dtype=torch.float64, requires_grad=True)
        _run(blocks, x, lambda blk, h: ours(blk, h))
    assert len(made) == len(blocks)  # one buffer per checkpoint, allocated in the first step only


@pytest.mark.parametrize("section, words", [
    ({"cpu_checkpointing": "yes"}, ["activation_checkpointing.cpu_checkpointing", "true or false"]),
    ({"partition_activations": True}, ["activation_checkpointing.partition_activations", "not implemented"]),
    ({"contiguous_memory_optimization": True}, ["contiguous_memory_optimization", "set it to false"]),
    ({"number_checkpoints": 0}, ["activation_checkpointing.number_checkpoints", "an integer >= 1"]),
    ({"cpu_checkpoint": True}, ["activation_checkpointing.cpu_checkpoint", "cpu_checkpointing"]),
])
def test_bad_sections_name_the_key(section, words):
    from polyaccel.engines.zero.activation_checkpoint import parse_activation_checkpointing
    from polyaccel.errors import ConfigError

    before = copy.deepcopy(section)
    with pytest.raises(ConfigError) as info:
        parse_activation_checkpointing(section)
    for w in words:
        assert w in str(info.value)
    assert section == before


def test_reentrant_is_refused():
    from polyaccel.errors import ConfigError

    with pytest.raises(ConfigError, match="use_reentrant"):
        _checkpointer()(torch.nn.Identity(), torch.randn(2, requires_grad=True), use_reentrant=True)


def test_engine_installs_it_into_a_hugging_face_model():
    """ZeRO with an ``activation_checkpointing`` section trains a Llama exactly as without it."""
    transformers = pytest.importorskip("transformers")
    import polyaccel

    cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=3,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32)
    torch.manual_seed(0)
    base = transformers.LlamaForCausalLM(cfg).double()
    ids = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(3))
    runs = []
    for section in (None, {"cpu_checkpointing": True}):
        config = {"zero_optimization": {"stage": 2}, "optimizer": {"type": "adamw", "params": {"lr": 1e-3}}}
        if section is not None:
            config["activation_checkpointing"] = section
        model = copy.deepcopy(base)
        model.train()
        engine = polyaccel.initialize(model, config)
        try:
            if section is not None:
                assert model.model.layers[0]._gradient_checkpointing_func is engine.checkpoint
            losses = []
            for step in range(3):
                loss = engine(input_ids=ids, labels=ids).loss
                engine.backward(loss)
                engine.step()
                losses.append(loss.item())
                assert engine.checkpoint.checkpoints == (3 * (step + 1) if section else 0)  # one per layer
            runs.append(losses)
        finally:
            engine.destroy()
    assert runs[1] == pytest.approx(runs[0], rel=1e-10)
    assert runs[0][-1] < runs[0][0]


@pytest.mark.parametrize("cpu_checkpointing", [False, True])
def test_recomputed_activations_go_as_soon_as_their_backward_used_them(cpu_checkpointing):
    """When backward reaches a checkpoint's input, every later checkpoint holds no recomputed tensor any more
    (holding them until backward ends would keep every checkpoint's activations at once)."""
    ours = _checkpointer(cpu_checkpointing=cpu_checkpointing)
    blocks = _blocks(seed=4)
    h = torch.randn(5, 8, dtype=torch.float64, requires_grad=True)
    outputs, frames = [], []
    for blk in blocks:
        h = ours(blk, h)
        outputs.append(h)
        frames.append(ours._last())
    held = {}
    for i, out in enumerate(outputs[:-1]):  # the gradient of block i's output: blocks after i are done
        out.register_hook(lambda g, i=i: held.__setitem__(i, [f.saved is not None for f in frames[i + 1:]]))
    h.square().sum().backward()
    assert sorted(held) == list(range(len(blocks) - 1))
    assert all(not any(flags) for flags in held.values()), held
    assert all(f.recomputed for f in frames)


def test_a_second_backward_through_a_checkpoint_is_refused_with_the_fix():
    ours = _checkpointer()
    blk = _blocks(seed=5, n=1)[0]
    x = torch.randn(3, 8, dtype=torch.float64, requires_grad=True)
    loss = ours(blk, x).square().sum()
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="second time.*run forward again"):
        loss.backward()


def test_recomputed_activations_need_no_garbage_collection_to_go():
    """After backward no recomputed tensor is left, with the garbage collector off: nothing in the
    recomputation closes a reference cycle (a tensor saved by its own node would, through autograd)."""
    ours = _checkpointer()
    blocks = _blocks(seed=6, n=3, width=8)
    x = torch.randn(5, 8, dtype=torch.float64, requires_grad=True)

    def hidden():  # the blocks' inner activations are (5, 16); nothing else here has that shape
        return sum(1 for o in gc.get_objects() if isinstance(o, torch.Tensor) and tuple(o.shape) == (5, 16))

    gc.collect()
    before = hidden()
    gc.disable()
    try:
        for _ in range(2):
            h = x
            for blk in blocks:
                h = ours(blk, h)
            h.square().sum().backward()
            h = None
            assert hidden() == before
    finally:
        gc.enable()
