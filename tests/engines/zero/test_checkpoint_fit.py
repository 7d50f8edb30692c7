"""A checkpoint loads only into the model it fits: names, full shapes, kinds and dtypes compared before anything
changes, at every stage and layout (flat version 1, grouped version 2), through ``engine.load_checkpoint``.

Round trip as a property (hypothesis): a random small model, stage, dtype and layout is saved, one thing is
changed (a shape, a name, a parameter added or removed, a buffer's dtype, frozen vs trainable), and loading is
either refused naming it with the model untouched, or (nothing changed) gives back exactly the saved model.
"""

from __future__ import annotations

import polyaccel
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from polyaccel.errors import CheckpointError

pytestmark = pytest.mark.timeout(180)


def _config(stage: int) -> dict:
    zero = {"stage": stage, "reduce_bucket_size": 64}
    if stage == 3:
        zero["stage3_param_persistence_threshold"] = 0
    return {"optimizer": {"type": "adamw", "params": {"lr": 1e-2}}, "zero_optimization": zero,
            "train_micro_batch_size_per_gpu": 1}


class Net(torch.nn.Module):
    def __init__(self, widths, bias=True, extra=False, frozen=(), buffer_dtype=torch.float32, dtype=torch.float32):
        super().__init__()
        self.layers = torch.nn.ModuleList(torch.nn.Linear(a, b, bias=bias, dtype=dtype)
                                          for a, b in zip(widths, widths[1:], strict=False))
        if extra:
            self.extra = torch.nn.Linear(widths[-1], 2, bias=False, dtype=dtype)
        self.register_buffer("scale", torch.arange(3).to(buffer_dtype))
        for i in frozen:
            self.layers[i].weight.requires_grad_(False)

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x.sum()


def _engine(net, stage, grouped=False):
    torch.set_num_threads(1)
    kw = {}
    if grouped:  # two weight decays: the grouped (version 2) checkpoint records
        names = [n for n, p in net.named_parameters() if p.requires_grad]
        kw["param_groups"] = [{"params": names[:1], "weight_decay": 0.0},
                              {"params": names[1:], "weight_decay": 0.1}]
    return polyaccel.initialize(net, _config(stage), **kw)


def _state(engine):
    return {k: v.detach().clone() for k, v in engine.full_state_dict().items()}


def _refused(engine, root, *words):
    before = _state(engine)
    with pytest.raises(CheckpointError, match="does not fit this model") as info:
        engine.load_checkpoint(root)
    for w in words:
        assert w in str(info.value), (w, str(info.value))
    after = _state(engine)
    assert before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before)
    return str(info.value)


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_linear_4_8_does_not_load_into_linear_8_4_nor_drop_what_the_model_lacks(stage, tmp_path):
    torch.manual_seed(0)
    src = _engine(Net([4, 8, 3], bias=False), stage)
    src.save_checkpoint(tmp_path / "a", tag="t")
    wide = _engine(Net([8, 4, 3], bias=False), stage)  # the same element counts, transposed shapes
    msg = _refused(wide, tmp_path / "a", "'layers.0.weight' has shape [8, 4] in the checkpoint, [4, 8] in the model")
    assert "'layers.1.weight' has shape [3, 8] in the checkpoint, [3, 4] in the model" in msg
    more = _engine(Net([4, 8, 3], bias=False, extra=True), stage)
    more.save_checkpoint(tmp_path / "b", tag="t")
    _refused(_engine(Net([4, 8, 3], bias=False), stage), tmp_path / "b", "'extra.weight' is not in the model")
    _refused(_engine(Net([4, 8, 3], bias=False, extra=True), stage), tmp_path / "a",
             "'extra.weight' is not in the checkpoint")
    for e in (src, wide, more):
        e.destroy()


def _mutations():
    return st.sampled_from(["none", "shape", "add", "remove", "buffer_dtype", "frozen"])


@settings(max_examples=14, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
@given(widths=st.lists(st.integers(1, 5), min_size=2, max_size=4), stage=st.sampled_from([1, 2, 3]),
       dtype=st.sampled_from([torch.float32, torch.float64]), grouped=st.booleans(), mutation=_mutations(),
       seed=st.integers(0, 2**16))
def test_round_trip_is_identical_or_refused(tmp_path_factory, widths, stage, dtype, grouped, mutation, seed):
    if len(widths) < 3:
        grouped = False  # one parameter group needs two trainable tensors to split
    root = tmp_path_factory.mktemp("ck")
    torch.manual_seed(seed)
    saved_net = Net(widths, dtype=dtype)
    src = _engine(saved_net, stage, grouped)
    src.save_checkpoint(root, tag="t")
    want = _state(src)
    src.destroy()
    kw = {"dtype": dtype}
    w = list(widths)
    if mutation == "shape":
        w[-1] += 1
    elif mutation == "add":
        kw["extra"] = True
    elif mutation == "remove":
        kw["bias"] = False
    elif mutation == "buffer_dtype":
        kw["buffer_dtype"] = torch.int64
    elif mutation == "frozen":
        kw["frozen"] = (0,)
        grouped = grouped and len(widths) > 3
    torch.manual_seed(seed + 1)
    dst = _engine(Net(w, **kw), stage, grouped)
    if mutation == "none":
        dst.load_checkpoint(root)
        got = _state(dst)
        assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)
    else:
        _refused(dst, root)
    dst.destroy()


def test_a_params_record_that_disagrees_with_the_layout_is_refused(tmp_path):
    from polyaccel.safe_files import dumps_checked, read_checked_json

    eng = _engine(Net([4, 8, 3], bias=False), 2)
    eng.save_checkpoint(tmp_path, tag="t")
    meta_path = tmp_path / "t" / "meta.json"
    meta, _ = read_checked_json(meta_path, "")
    meta["params"]["layers.0.weight"] = [4, 8]  # re-checksummed: only the record lies
    meta_path.write_text(dumps_checked(meta))
    with pytest.raises(CheckpointError, match="'params' record does not match the partition layout"):
        eng.load_checkpoint(tmp_path)
    eng.destroy()
