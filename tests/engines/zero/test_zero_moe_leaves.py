"""ZeRO stage 3 on MoE layouts whose experts run only where tokens are routed, routing forced to differ by rank.

The per-expert layouts of :mod:`moe_testlib` (a Qwen3-MoE with a wrapper holding a ModuleList of
experts, numbered expert attributes reached with ``getattr``, a ModuleDict of experts inside a
wrapper) must become stage-3 leaves without configuration, and 10 steps on 2 and 4 gloo ranks, at
stage 3 and stage 3 with the optimizer offloaded, with ``stage3_module_granularity_threshold``, with
activation checkpointing and without the schedule check, must equal single-process training
(float64 within 1e-10, float32 within 1e-5), issuing the same collectives on every rank.
"""

from __future__ import annotations

import pytest
import torch
from moe_testlib import STEPS, batch, build, config, loss_of, reference
from polyaccel.engines.zero.leaves import find_leaf_modules
from polyaccel.testing.multiprocess import run_ranks

pytestmark = pytest.mark.timeout(300)

# name: (layout, dtype, config, HF activation checkpointing)
CASES = {
    "qwen3-wrapper-s3": ("qwen3-wrapper", torch.float64, config(), False),
    "qwen3-wrapper-s3-offload": ("qwen3-wrapper", torch.float64, config(offload=True), False),
    "qwen3-wrapper-s3-fp32": ("qwen3-wrapper", torch.float32, config(), False),
    # each decoder layer (about 900 elements) is gathered whole; the experts' wrapper is inside it
    "qwen3-wrapper-s3-granular": ("qwen3-wrapper", torch.float64,
                                  config(stage3_module_granularity_threshold=1000), False),
    # recomputation in backward runs the wrapper (and its routing) again
    "qwen3-wrapper-s3-actckpt": ("qwen3-wrapper", torch.float64, config(actckpt=True), True),
    "getattr-s3-offload": ("getattr", torch.float64, config(offload=True), False),
    "bank-s3": ("bank", torch.float64, config(), False),
    # no agreements: backward's reductions wait for a backward fetch, where the ranks exchange what is complete
    "bank-s3-unchecked": ("bank", torch.float64, config(stage3_check_schedule=False), False),
}
FOUR_RANK_CASES = ("qwen3-wrapper-s3", "qwen3-wrapper-s3-offload")


def train_cases(rank: int, world: int, names: list[str]) -> dict:
    import polyaccel
    from polyaccel import comm
    from polyaccel.comm.tracing import CommTracer

    torch.set_num_threads(1)
    out = {}
    for name in names:
        kind, dtype, cfg, actckpt = CASES[name]
        engine = polyaccel.initialize(build(kind, dtype, actckpt), cfg)
        losses, traces = [], []
        for step in range(STEPS):
            with CommTracer() as tracer:
                loss = loss_of(engine, batch(step, rank))
                engine.backward(loss)
                engine.step()
            traces.append([(e.op, e.bytes) for e in tracer.events])
            t = torch.tensor([loss.item()], dtype=torch.float64)
            comm.all_reduce(t)
            losses.append(t.item() / world)
        params = engine.full_state_dict()
        out[name] = {"losses": losses, "trace": traces, "params": params if rank == 0 else None,
                     "checkpoints": engine.checkpoint.checkpoints}
        engine.destroy()
    return out


@pytest.fixture(scope="module", params=[2, 4], ids=["2ranks", "4ranks"])
def world_results(request):
    world = request.param
    names = list(CASES) if world == 2 else list(FOUR_RANK_CASES)
    return world, names, run_ranks(train_cases, world, names, timeout=280, comm_timeout=60)


def test_matches_single_process_training_and_issues_the_same_collectives_everywhere(world_results):
    world, names, results = world_results
    torch.set_num_threads(1)  # tiny tensors on shared cores: intra-op threads only add overhead
    refs = {}
    for name in names:
        kind, dtype, _cfg, actckpt = CASES[name]
        if (kind, dtype) not in refs:
            refs[kind, dtype] = reference(kind, dtype, world)
        ref_losses, ref_params = refs[kind, dtype]
        tol = 1e-10 if dtype == torch.float64 else 1e-5
        got = results[0][name]
        for step, (a, b) in enumerate(zip(got["losses"], ref_losses, strict=True)):
            assert abs(a - b) <= tol * max(1.0, abs(b)), f"{name}, {world} ranks: loss of step {step}: {a} vs {b}"
        for key, ref in ref_params.items():
            err = (got["params"][key].double() - ref.double()).abs().max().item()
            assert err <= tol, f"{name}, {world} ranks: parameter {key} off by {err:.3g}"
        assert (got["checkpoints"] > 0) == actckpt, name
        for rank in range(1, world):
            assert results[rank][name]["trace"] == got["trace"], f"{name}: rank {rank} issued other collectives"


@pytest.mark.parametrize("kind, leaves", [
    ("qwen3-wrapper", ["model.layers.0.mlp.experts", "model.layers.1.mlp.experts"]),
    ("getattr", ["block"]),
    ("bank", ["block.ffn"]),
])
def test_per_expert_layouts_are_leaves_without_configuration(kind, leaves):
    assert list(find_leaf_modules(build(kind, torch.float64))) == leaves


def test_fused_experts_and_dense_stacks_are_not_leaves_but_a_list_of_experts_on_the_block_is():
    from moe_testlib import Expert
    from transformers import LlamaConfig, LlamaForCausalLM, MixtralConfig, MixtralForCausalLM

    def mixtral():
        cfg = MixtralConfig(vocab_size=32, hidden_size=8, intermediate_size=6, num_hidden_layers=2,
                            num_attention_heads=2, num_key_value_heads=1, head_dim=4, num_local_experts=4,
                            num_experts_per_tok=2)
        return MixtralForCausalLM(cfg)

    fused = mixtral()  # 3-D expert weights in one module: gathered whole with no leaf
    assert find_leaf_modules(fused) == {}
    assert find_leaf_modules(build("qwen3-wrapper", torch.float64).model.layers[0].self_attn) == {}
    llama = LlamaForCausalLM(LlamaConfig(vocab_size=32, hidden_size=8, intermediate_size=12, num_hidden_layers=3,
                                         num_attention_heads=2, num_key_value_heads=1))
    assert find_leaf_modules(llama) == {}  # a ModuleList of layers is no list of experts
    per_expert = mixtral()  # the older Hugging Face layout: a ModuleList named experts on the block
    for layer in per_expert.model.layers:
        layer.mlp.experts = torch.nn.ModuleList(Expert() for _ in range(4))
    assert list(find_leaf_modules(per_expert)) == ["model.layers.0.mlp", "model.layers.1.mlp"]
