"""Stage 3's schedule check never hangs: a rank that skips a gathered module outside any leaf makes every
rank raise ScheduleMismatch at once, naming the module and the fix, never a comm timeout.

One spawned pair of ranks runs every scenario in turn (the process group stays usable: every rank
fails at the same agreement). The communication timeout is 30 s, so a rank left waiting would show
as a CommTimeoutError, and each failure must come within 5 s of the call that hit it.
"""

from __future__ import annotations

import time

import pytest
import torch
from polyaccel.testing.multiprocess import run_ranks

pytestmark = pytest.mark.timeout(200)

VOCAB, HIDDEN, SEQ = 16, 8, 5


class Body(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.up = torch.nn.Linear(HIDDEN, 2 * HIDDEN)
        self.down = torch.nn.Linear(2 * HIDDEN, HIDDEN)

    def forward(self, h):
        return h + self.down(torch.tanh(self.up(h)))


class SkipLM(torch.nn.Module):
    """``where`` (``(place, runs)``) says where a rank with ``runs`` false leaves out ``side``, a module in no leaf:

    - ``"middle"``: not run between ``body`` and ``head`` (the ranks' next gathers differ);
    - ``"end"``: not run after ``head``, the last module (this rank reaches the end of forward);
    - ``"backward"``: run first, without autograd (no backward gather for it here, where the others'
      last gather of backward is its: this rank reaches the end of backward).
    """

    def __init__(self):
        super().__init__()
        self.side = torch.nn.Embedding(VOCAB, VOCAB)
        self.embed = torch.nn.Embedding(VOCAB, HIDDEN)
        self.body = Body()
        self.head = torch.nn.Linear(HIDDEN, VOCAB)
        self.where = ("", True)
        self.checkpoint = None  # engine.checkpoint, to run ``body`` checkpointed

    def forward(self, ids):
        place, runs = self.where
        bias = 0
        if place == "backward":
            with torch.set_grad_enabled(runs):
                bias = self.side(ids)
        h = self.embed(ids)
        h = self.checkpoint(self.body, h) if self.checkpoint is not None else self.body(h)
        if place == "middle" and runs:
            h = h + self.side(ids)[..., :HIDDEN]
        logits = self.head(h) + bias
        if place == "end" and runs:
            logits = logits + self.side(ids)
        return torch.nn.functional.cross_entropy(logits.reshape(-1, VOCAB), ids.roll(1, 1).reshape(-1))


def _config(**zero) -> dict:
    z = {"stage": 3, "reduce_bucket_size": 100, "stage3_param_persistence_threshold": 0,
         "stage3_prefetch_bucket_size": 200, **zero}
    return {"optimizer": {"type": "adamw", "params": {"lr": 1e-2}}, "zero_optimization": z}


# name: (where the skipping rank leaves ``side`` out, config, checkpoint ``body``)
SCENARIOS = {
    "middle": ("middle", _config(), False),
    "end-of-forward": ("end", _config(), False),
    "end-of-backward": ("backward", _config(), False),
    # ``body`` (two linears, 280 elements) one leaf
    "end-of-forward-granular": ("end", _config(stage3_module_granularity_threshold=300), False),
    "end-of-backward-granular": ("backward", _config(stage3_module_granularity_threshold=300), False),
    # ``body`` recomputed in backward, its gathers agreed on like any other
    "end-of-forward-actckpt": ("end", {**_config(), "activation_checkpointing": {}}, True),
    "end-of-backward-actckpt": ("backward", {**_config(), "activation_checkpointing": {}}, True),
}


def run_scenarios(rank: int, world: int) -> dict:
    import polyaccel

    torch.set_num_threads(1)
    out = {}
    for name, (where, cfg, checkpointed) in SCENARIOS.items():
        torch.manual_seed(0)
        model = SkipLM().double()
        model.where = (where, rank != 1)
        engine = polyaccel.initialize(model, cfg)
        if checkpointed:
            model.checkpoint = engine.checkpoint
        ids = torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(rank))
        phase, start = "forward", time.monotonic()
        try:
            for _ in range(3):
                phase, start = "forward", time.monotonic()
                loss = engine(ids)
                phase, start = "backward", time.monotonic()
                engine.backward(loss)
                engine.step()
            out[name] = {"error": None}
        except Exception as exc:  # what each rank raised, and how long after the call began
            out[name] = {"error": type(exc).__name__, "message": str(exc), "phase": phase,
                         "seconds": time.monotonic() - start, "checkpoints": engine.checkpoint.checkpoints}
        engine.destroy()
    return out


@pytest.fixture(scope="module")
def results():
    return run_ranks(run_scenarios, 2, timeout=180, comm_timeout=30)


@pytest.mark.parametrize("name", list(SCENARIOS))
def test_every_rank_raises_schedule_mismatch_at_once(results, name):
    where, _cfg, checkpointed = SCENARIOS[name]
    got = [results[rank][name] for rank in range(2)]
    for rank, g in enumerate(got):
        assert g["error"] == "ScheduleMismatch", f"{name}: rank {rank} raised {g['error']}: {g.get('message')}"
        assert g["seconds"] < 5, f"{name}: rank {rank} took {g['seconds']:.1f} s to fail"
        assert g["phase"] == ("backward" if where == "backward" else "forward"), (name, rank, g["phase"])
        assert (g["checkpoints"] > 0) == checkpointed, name
    text = got[0]["message"]
    assert got[1]["message"] == text, "every rank names the same modules"
    assert "'side'" in text and "stage3_leaf_modules=[" in text, text
    if where == "middle":
        assert "rank(s) [0] gather module 'side'" in text and "rank(s) [1] gather module 'head'" in text, text
    else:
        phase = "backward" if where == "backward" else "forward"
        assert f"rank(s) [1] reached the end of {phase} with nothing left to gather" in text, text
        assert "rank(s) [0] gather module 'side' (side.weight)" in text, text
    assert "'SkipLM'" in text, text  # nothing but the model encloses ``side``: the message says so


def test_the_suggested_leaf_is_the_module_around_the_alternatives():
    import moe_testlib
    from polyaccel.engines.zero.schedule import GatherSchedule

    model = moe_testlib.build("qwen3-wrapper", torch.float64)
    schedule = GatherSchedule(None, torch.device("cpu"), model, owner=str, param_name=str)
    experts = "model.layers.0.mlp.experts"
    assert schedule.enclosing([f"{experts}.mlps.0.gate_up", f"{experts}.mlps.1.gate_up"]) == experts
    assert schedule.enclosing([f"{experts}.mlps.3.down"]) == experts  # one expert of many: the wrapper
    assert schedule.enclosing(["model.layers.1.self_attn.q_proj"]) == "model.layers.1.self_attn"
    # two layers: past the ModuleList that holds them, to the model that calls them
    assert schedule.enclosing(["model.layers.1.mlp.gate", f"{experts}.mlps.0.down"]) == "model"
    assert schedule.enclosing(["lm_head"]) == ""
