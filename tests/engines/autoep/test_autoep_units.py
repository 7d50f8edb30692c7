"""AutoEP without a process group: config validation, detection, errors before any change, plans, ep 1."""

from __future__ import annotations

import copy
import json

import pytest
import torch
from autoep_testlib import LegacyModel, build
from polyaccel.engines.autoep import LayoutError, apply_autoep, detect, ep_plan, parse_config
from polyaccel.engines.autoep import layer as ep_layer
from polyaccel.errors import ConfigError
from polyaccel.parallel import get_layout


class FakeMesh:
    """Sizes and ranks of a mesh without a process group (enough to place experts; not to run them)."""

    def __init__(self, expert: int, rank: int, data: int | None = None):
        self.expert, self.r, self.data = expert, rank, data or expert

    def size(self, dim):
        return {"expert": self.expert, "data": self.data, "expert_data": self.data // self.expert}[dim]

    def rank(self, dim):
        return self.r if dim == "expert" else 0

    def group(self, dim):
        return None


def _snapshot(model):
    return {k: v.clone() for k, v in model.state_dict().items()}, [type(m).__name__ for m in model.modules()]


def _assert_untouched(model, snap):
    state, types = snap
    assert [type(m).__name__ for m in model.modules()] == types
    now = model.state_dict()
    assert set(now) == set(state)
    for k, v in state.items():
        assert torch.equal(now[k], v), k
    assert not hasattr(model, "autoep_plan")


# ------------------------------------------------------------------------------------------ config
def test_entry_point_is_declared():
    from polyaccel.engine_entry import model_layers

    mod = model_layers()["expert_parallel"].load()
    assert mod.ORDER == 10 and callable(mod.mesh_sizes) and callable(mod.apply)


def test_expert_tensor_parallel_size_other_than_one_is_refused_with_the_reason():
    assert parse_config({"expert_tensor_parallel_size": 1}).expert_tensor_parallel_size == 1
    with pytest.raises(ConfigError, match=r"expert_tensor_parallel_size' is 2: splitting expert weights over the "
                                          r"tensor ranks is not supported.*a larger autoep_size"):
        parse_config({"autoep_size": 2, "expert_tensor_parallel_size": 2})
    with pytest.raises(ConfigError, match="must be an integer >= 1"):
        parse_config({"expert_tensor_parallel_size": 0})


def test_mesh_sizes_validates_and_leaves_the_dict_alone():
    section = {"autoep_size": 4, "top_k": 2, "num_expert_groups": 4, "num_limited_groups": 2}
    before = copy.deepcopy(section)
    assert ep_layer.mesh_sizes(section) == {"expert": 4}
    assert section == before
    assert ep_layer.mesh_sizes({"enabled": False, "autoep_size": 4}) == {"expert": 1}
    assert ep_layer.mesh_sizes({}) == {"expert": 1}


@pytest.mark.parametrize("section, words", [
    ({"autoep_sise": 2}, ["'expert_parallel.autoep_sise'", "autoep_size", "score_func"]),
    ({"autoep_size": 0}, ["'expert_parallel.autoep_size'", ">= 1"]),
    ({"autoep_size": True}, ["'expert_parallel.autoep_size'"]),
    ({"score_func": "relu"}, ["'expert_parallel.score_func'", "softmax", "sigmoid"]),
    ({"score_apply": "mid"}, ["'expert_parallel.score_apply'", "pre", "post"]),
    ({"preset_model": "llama"}, ["'expert_parallel.preset_model'", "mixtral", "deepseek_v3"]),
    ({"route_norm": "yes"}, ["'expert_parallel.route_norm'"]),
    ({"routed_scaling_factor": -1}, ["'expert_parallel.routed_scaling_factor'"]),
    ({"num_expert_groups": 4}, ["num_limited_groups", "set both"]),
    ({"num_expert_groups": 2, "num_limited_groups": 3}, ["must not exceed"]),
    ({"moe_layer_pattern": "model.(layers"}, ["'expert_parallel.moe_layer_pattern'", "regular expression"]),
    ({"expert_w1": "fc1"}, ["expert_w2", "expert_w3"]),
    ({"top_k": 0}, ["'expert_parallel.top_k'"]),
    ("not a dict", ["'expert_parallel'", "dict"]),
])
def test_bad_config_names_the_key(section, words):
    with pytest.raises(ConfigError) as err:
        parse_config(section)
    for w in words:
        assert w in str(err.value), (w, str(err.value))


# ------------------------------------------------------------------------------------------ detection
def test_detects_qwen2_moe_shared_expert_and_dense_layer():
    plan = detect(build("qwen2_moe"), parse_config({}))
    assert [s.name for s in plan.layers] == ["model.layers.1.mlp"]
    assert plan.dense == [("model.layers.0.mlp", "Qwen2MoeMLP")]
    s = plan.layers[0]
    assert (s.shared_name, s.shared_gate_name, s.num_experts, s.ffn_size, s.hidden_size) == (
        "shared_expert", "shared_expert_gate", 8, 24, 32)
    assert s.routing.score_func == "softmax" and s.routing.route_norm is False and s.routing.top_k == 2


def test_detects_deepseek_v3_routing():
    s = detect(build("deepseek_v3"), parse_config({})).layers[0]
    r = s.routing
    assert (r.score_func, r.route_norm, r.scale, r.num_groups, r.limited_groups, r.group_score,
            r.correction_bias) == ("sigmoid", True, 2.5, 4, 2, "top2_sum", True)
    assert s.shared_name == "shared_experts" and s.shared_gate_name is None


def test_knobs_override_the_family():
    r = detect(build("mixtral"), parse_config({"top_k": 3, "route_norm": False, "routed_scaling_factor": 2.0,
                                                "score_func": "sigmoid"})).layers[0].routing
    assert (r.top_k, r.route_norm, r.scale, r.score_func) == (3, False, 2.0, "sigmoid")


def test_a_pattern_matching_dense_layers_leaves_them_alone():
    model = build("qwen2_moe")
    plan = detect(model, parse_config({"moe_layer_pattern": r"model\.layers\.\d+\.mlp"}))
    assert [s.name for s in plan.layers] == ["model.layers.1.mlp"]
    assert [n for n, _ in plan.dense] == ["model.layers.0.mlp"]


def _errors(model, section, ep_size=None):
    snap = _snapshot(model)
    with pytest.raises(ConfigError) as err:
        if ep_size is None:
            apply_autoep(model, section)
        else:
            ep_layer.apply(model, {**section, "autoep_size": ep_size}, FakeMesh(ep_size, 0))
    _assert_untouched(model, snap)
    return str(err.value)


def test_autoep_size_must_divide_the_experts():
    msg = _errors(build("mixtral"), {}, ep_size=3)
    assert "autoep_size'=3 does not divide the 8 experts of model.layers.0.mlp" in msg
    assert "1, 2, 4, 8" in msg


def test_config_and_router_expert_counts_must_agree():
    model = build("mixtral")
    model.config.num_local_experts = 6
    msg = _errors(model, {})
    assert "num_local_experts=6" in msg and "8 rows" in msg and "num_experts_attr" in msg


def test_an_override_pattern_that_matches_nothing():
    msg = _errors(build("mixtral"), {"moe_layer_pattern": r"transformer\.h\.\d+\.moe"})
    assert "transformer\\\\.h" in msg or "transformer\\.h" in msg
    assert "matches no module" in msg and "model.layers.0.mlp" in msg
    msg = _errors(build("mixtral"), {"shared_expert_pattern": "common_expert"})
    assert "'expert_parallel.shared_expert_pattern' is 'common_expert'" in msg


def test_no_moe_block_says_what_to_set():
    from transformers import LlamaConfig, LlamaForCausalLM

    model = LlamaForCausalLM(LlamaConfig(vocab_size=61, hidden_size=16, intermediate_size=24, num_hidden_layers=1,
                                         num_attention_heads=2, num_key_value_heads=1))
    msg = _errors(model, {})
    assert "no MoE block found in LlamaForCausalLM" in msg and "model.layers.0.mlp" in msg
    assert "expert_pattern" in msg and "moe_layer_pattern" in msg


def test_unknown_expert_layout_is_described():
    model = build("mixtral")
    model.model.layers[1].mlp.experts = torch.nn.Linear(32, 8)  # not an experts layout
    msg = _errors(model, {})
    assert "model.layers.1.mlp.experts (Linear)" in msg and "weight [8, 32]" in msg
    assert "expert_w1/expert_w2/expert_w3" in msg and "moe_layer_pattern" in msg
    with pytest.raises(LayoutError):
        detect(model, parse_config({}))


def test_unknown_family_asks_for_a_preset():
    msg = _errors(LegacyModel(), {})
    assert "no AutoEP routing preset" in msg and "preset_model" in msg and "score_func" in msg
    plan = detect(LegacyModel(), parse_config({"preset_model": "mixtral"}))
    assert [s.layout for s in plan.layers] == ["ModuleList", "ModuleList"]
    assert all(s.returns_router_logits for s in plan.layers)


class _RenamedExpert(torch.nn.Module):
    def __init__(self, e):
        super().__init__()
        self.fc_gate, self.fc_down, self.fc_up, self.act_fn = e.w1, e.w2, e.w3, e.act_fn

    def forward(self, x):
        return self.fc_down(self.act_fn(self.fc_gate(x)) * self.fc_up(x))


def test_module_list_projection_names_override():
    model = LegacyModel().double()
    for block in model.layers:
        experts = block["block_sparse_moe"].experts
        for i in range(len(experts)):
            experts[i] = _RenamedExpert(experts[i])
    msg = _errors(model, {"preset_model": "mixtral"})
    assert "w1/w2/w3" in msg and "'expert_parallel.expert_w1'" in msg and "fc_gate" in msg
    ref = copy.deepcopy(model)
    apply_autoep(model, {"preset_model": "mixtral", "expert_w1": "fc_gate", "expert_w2": "fc_down",
                         "expert_w3": "fc_up"})
    x = torch.randn(2, 5, 32, dtype=torch.float64)
    for a, b in zip(model.layers, ref.layers, strict=True):
        got, want = a["block_sparse_moe"](x), b["block_sparse_moe"](x)
        torch.testing.assert_close(got[0], want[0], rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(got[1], want[1], rtol=0, atol=0)


class _TransposedExperts(torch.nn.Module):
    """Fused experts stored [E, H, 2F] / [E, F, H] (``is_transposed``), like some transformers-5 models."""

    def __init__(self, E=4, H=32, F=16):
        super().__init__()
        self.gate_up_proj = torch.nn.Parameter(torch.randn(E, H, 2 * F, dtype=torch.float64) * 0.1)
        self.down_proj = torch.nn.Parameter(torch.randn(E, F, H, dtype=torch.float64) * 0.1)
        self.is_transposed = True
        self.act_fn = torch.nn.SiLU()


class _TransposedBlock(torch.nn.Module):
    def __init__(self, top_k=2):
        super().__init__()
        torch.manual_seed(3)
        self.gate = torch.nn.Linear(32, 4, bias=False).double()
        self.experts = _TransposedExperts()
        self.top_k = top_k

    def forward(self, hidden):
        x = hidden.reshape(-1, hidden.shape[-1])
        probs = torch.softmax(self.gate(x).float(), dim=-1)
        w, sel = torch.topk(probs, self.top_k, dim=-1)
        w = w / w.sum(-1, keepdim=True)
        out = torch.zeros_like(x)
        for e in range(4):
            tok, pos = torch.where(sel == e)
            gate, up = (x[tok] @ self.experts.gate_up_proj[e]).chunk(2, dim=-1)
            y = (torch.nn.functional.silu(gate) * up) @ self.experts.down_proj[e]
            out.index_add_(0, tok, y * w[tok, pos, None])
        return out.view(hidden.shape)


@pytest.mark.parametrize("top_k", [2, 4])  # 4 of 4 experts: the dense path, on weights it must copy to lay out
def test_transposed_fused_layout(top_k):
    model = torch.nn.Module()
    model.layers = torch.nn.ModuleList([torch.nn.ModuleDict({"mlp": _TransposedBlock(top_k)})])
    ref = copy.deepcopy(model)
    apply_autoep(model, {"score_func": "softmax", "route_norm": True})
    assert model.autoep_plan.layers[0].layout == "fused 3-D transposed"
    x = torch.randn(3, 4, 32, dtype=torch.float64)
    got, want = model.layers[0]["mlp"](x), ref.layers[0]["mlp"](x)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    grad = torch.randn_like(got)
    got.backward(grad)
    want.backward(grad)
    got_g = dict(model.named_parameters())
    for name, p in ref.named_parameters():
        torch.testing.assert_close(got_g[name].grad, p.grad, rtol=1e-10, atol=1e-10, msg=lambda m, n=name: f"{n}: {m}")


def test_expert_biases_are_refused_with_the_reason():
    from transformers import GptOssConfig, GptOssForCausalLM

    torch.manual_seed(0)
    model = GptOssForCausalLM(GptOssConfig(vocab_size=61, hidden_size=32, intermediate_size=16, num_hidden_layers=1,
                                           num_attention_heads=2, num_key_value_heads=1, head_dim=16,
                                           num_local_experts=4, num_experts_per_tok=2,
                                           experts_implementation="eager"))
    msg = _errors(model, {"score_func": "softmax", "route_norm": True})
    assert "model.layers.0.mlp.experts" in msg and "expert biases" in msg and "moe_layer_pattern" in msg


# ------------------------------------------------------------------------------------------ placement
@pytest.mark.parametrize("ep, rank", [(1, 0), (2, 1), (4, 2)])
def test_placement_names_and_layouts(ep, rank):
    model = build("deepseek_v3")
    names = {k: v.shape for k, v in model.state_dict().items()}
    ep_layer.apply(model, {"autoep_size": ep}, FakeMesh(ep, rank, data=4))
    state = model.state_dict()
    assert set(state) == set(names), "the HF parameter names are kept"
    block = model.model.layers[1].mlp
    experts = block.experts
    n = 8 // ep
    assert experts.first_expert == rank * n and experts.num_local_experts == n
    ref = build("deepseek_v3").model.layers[1].mlp.experts
    torch.testing.assert_close(experts.gate_up_proj, ref.gate_up_proj[rank * n:(rank + 1) * n], rtol=0, atol=0)
    torch.testing.assert_close(experts.down_proj, ref.down_proj[rank * n:(rank + 1) * n], rtol=0, atol=0)
    for pname in ("gate_up_proj", "down_proj"):
        lay = get_layout(getattr(experts, pname))
        assert lay.replicas == "expert_data" and lay.split.dim == "expert" and lay.split.axis == 0
        assert lay.split.sections == ((n,) * ep,) and lay.split.rank == rank
        assert tuple(state[f"model.layers.1.mlp.experts.{pname}"].shape[1:]) == tuple(names[
            f"model.layers.1.mlp.experts.{pname}"][1:])
    for name, p in model.named_parameters():
        if ".experts." not in name:
            assert get_layout(p).replicas == "data" and get_layout(p).split is None, name
    assert ep_plan(model) is model.autoep_plan and model.autoep_plan.expert_data == 4 // ep


def test_mesh_and_section_must_agree():
    model = build("mixtral")
    snap = _snapshot(model)
    with pytest.raises(ConfigError, match="autoep_size' is 2 but the mesh's expert dimension is 4"):
        ep_layer.apply(model, {"autoep_size": 2}, FakeMesh(4, 0))
    _assert_untouched(model, snap)
    assert ep_layer.apply(model, {"enabled": False, "autoep_size": 4}, FakeMesh(4, 0)) is model
    _assert_untouched(model, snap)


# ------------------------------------------------------------------------------------------ ep 1, whole models
@pytest.mark.parametrize("family", ["mixtral", "qwen2_moe", "qwen3_moe", "olmoe", "deepseek_v3", "glm4_moe"])
def test_whole_model_at_ep1_equals_hf(family):
    from autoep_testlib import batch, lm_loss

    model = build(family)
    ref = copy.deepcopy(model)
    apply_autoep(model, {})
    ids = batch(0, 0)
    got = model(input_ids=ids, output_router_logits=True)
    want = ref(input_ids=ids, output_router_logits=True)
    torch.testing.assert_close(got.logits, want.logits, rtol=1e-10, atol=1e-10)
    if want.aux_loss is not None:
        torch.testing.assert_close(got.aux_loss, want.aux_loss, rtol=1e-10, atol=1e-10)
    lm_loss(model, ids).backward()
    lm_loss(ref, ids).backward()
    got_g = dict(model.named_parameters())
    for name, p in ref.named_parameters():
        tol = 1e-6 if (family in ("deepseek_v3", "glm4_moe") and name.endswith("mlp.gate.weight")) else 1e-10
        torch.testing.assert_close(got_g[name].grad, p.grad, rtol=tol, atol=tol, msg=lambda m, n=name: f"{n}: {m}")


@pytest.mark.parametrize("family,kw", [("mixtral", {}), ("qwen2_moe", {}), ("deepseek_v3", {"topk_group": 4})])
def test_every_token_to_every_expert_runs_as_one_dense_mlp_and_equals_hf(family, kw, monkeypatch):
    from autoep_testlib import batch, lm_loss
    from polyaccel.engines.autoep import moe

    model = build(family, experts=8, top_k=8, **kw)
    ref = copy.deepcopy(model)
    apply_autoep(model, {})
    dense, routed = [], []
    for name, seen in (("run_dense_experts", dense), ("run_experts", routed)):
        real = getattr(moe, name)
        monkeypatch.setattr(moe, name, lambda *a, real=real, seen=seen: seen.append(1) or real(*a))
    ids = batch(0, 0)
    torch.testing.assert_close(model(input_ids=ids).logits, ref(input_ids=ids).logits, rtol=1e-10, atol=1e-10)
    blocks = [m for m in model.modules() if isinstance(m, moe.AutoEPMoE)]
    assert len(dense) == len(blocks) > 0 and not routed
    assert all(b.last_dispatch["counts"].tolist() == [ids.numel()] * 8 for b in blocks)
    lm_loss(model, ids).backward()
    lm_loss(ref, ids).backward()
    got_g = dict(model.named_parameters())
    for name, p in ref.named_parameters():
        tol = 1e-6 if (family == "deepseek_v3" and name.endswith("mlp.gate.weight")) else 1e-10
        torch.testing.assert_close(got_g[name].grad, p.grad, rtol=tol, atol=tol, msg=lambda m, n=name: f"{n}: {m}")
    for b in blocks:  # the routed path, asked for, gives the same numbers
        b.dense_when_all_chosen = False
    torch.testing.assert_close(model(input_ids=ids).logits, ref(input_ids=ids).logits, rtol=1e-10, atol=1e-10)
    assert len(routed) == len(blocks)


def test_bf16_forward_is_close_and_uses_the_registry():
    from polyaccel import ops

    torch.manual_seed(0)
    model = build("mixtral").to(torch.bfloat16)
    ref = copy.deepcopy(model)
    apply_autoep(model, {})
    x = torch.randn(2, 9, 32, dtype=torch.bfloat16)
    got = model.model.layers[0].mlp(x)
    want = ref.model.layers[0].mlp(x)
    assert got.dtype == torch.bfloat16
    assert (got.float() - want.float()).abs().max() < 2e-2
    assert ops.registry.chosen("grouped_mm", "cpu").name


# ------------------------------------------------------------------------------------------ command
def _plan_cmd(argv):
    import argparse

    from polyaccel.engines.autoep import cli_plan

    parser = argparse.ArgumentParser()
    cli_plan.add_arguments(parser)
    return cli_plan.run(parser.parse_args(argv))


def test_autoep_plan_command(capsys):
    assert _plan_cmd(["--model", "deepseek_v3", "--ep", "8"]) == 0
    out = capsys.readouterr().out
    assert "DeepseekV3ForCausalLM" in out and "ep=8" in out and "58 MoE layer(s)" in out
    assert "model.layers.3-60.mlp (58 layers)" in out and "256 x [7168->2048]" in out
    assert "r0:0-31 r1:32-63 ... r7:224-255" in out and "groups 4/8 by top2_sum" in out
    assert _plan_cmd(["--model", "qwen2_moe", "--ep", "2", "--tiny", "--config", json.dumps({"top_k": 4})]) == 0
    out = capsys.readouterr().out
    assert "softmax top-4" in out and "shared_expert (+sigmoid shared_expert_gate)" in out
    assert _plan_cmd(["--model", "mixtral", "--ep", "3"]) == 1
    assert "does not divide the 8 experts" in capsys.readouterr().err
    assert _plan_cmd(["--model", "llama", "--ep", "2"]) == 2  # a --model that builds nothing: a usage error
    assert "choose one of mixtral" in capsys.readouterr().err
