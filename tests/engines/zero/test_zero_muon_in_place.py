"""The owner's Newton-Schulz in place (``muon_batches``: each batch of the plan one view of the round buffer, one
``newton_schulz`` call writing the result over it, ``out=`` the blocks) takes the steps of the previous owner's path
(matrices laid out in layout order, the blocks of one wide shape gathered by ``torch.cat``, split, transposed and
re-joined per matrix, copied back by ``_foreach_copy_``; written out below as it was), on the cpu plugin where the
op's reference serves, at world 1 and over 2 gloo ranks, with and without per-head blocks (row-split and tall
column-split blocks), tall and wide matrices, fp32 and bf16 models, on the device path and the kept buffers' (host)
path: bit for bit with the bf16 and fp16 iterations; within rounding with the fp32 one (see CASES). Around the op
calls it copies only column-split heads of several matrices (in and out) and casts where the buffer is not of the
iteration's dtype: the previous path's gathering ``cat`` and per-matrix copies back (split, transposed, heads
re-joined) are gone; the counts before and after are printed."""

from __future__ import annotations

import pytest
import torch
from muon_testlib import muon_config
from polyaccel.engines.zero.muon_batches import blocks_of
from polyaccel.testing.multiprocess import run_ranks
from torch.utils._python_dispatch import TorchDispatchMode
from zero_testlib import build_model, global_batch, loss_of

pytestmark = pytest.mark.timeout(300)

STEPS = 2


def legacy_layout(opt) -> None:
    """The previous plan's places: an owner's matrices in layout order in its chunk of the round."""
    for rnd in opt.rounds:
        fill = [0] * opt.coll.world
        for m in rnd.matrices:
            m.offset = fill[m.owner]
            fill[m.owner] += m.numel


def legacy_orthogonalized(self, rnd, send):
    """The owner's part before the in-place batches: views per matrix, ``orthogonalize_many``, copied back."""
    from polyaccel.engines.zero import muon as zmuon

    send, mine = self._to_owners(rnd, send)
    owned = [m for m in rnd.matrices if m.owner == self.coll.rank]
    views = [mine[m.offset:m.offset + m.numel].view(m.shape) for m in owned]
    done = zmuon.orthogonalize_many(views, [m.head_split for m in owned], self.mcfg)
    torch._foreach_copy_(views, done)
    self.orthogonalized += len(owned)
    if self.coll.world > 1:
        self.coll.all_gather(send, mine)
    return send


#: ops that launch no kernel: views and allocations
_NO_KERNEL = {"empty", "empty_like", "split", "split_with_sizes", "slice", "view", "alias", "detach", "as_strided",
              "_unsafe_view"}


def _numel(x) -> int:
    if isinstance(x, torch.Tensor):
        return x.numel()
    return sum(_numel(t) for t in x) if isinstance(x, (list, tuple)) else 0


class Calls(TorchDispatchMode):
    """Counts the dispatcher calls that launch a kernel on a device (not views or allocations) inside the block,
    apart: ``ns``, the ``newton_schulz`` calls (whose insides are the op's), and ``other``, the calls around them,
    with ``written``, the elements those write; collectives (:meth:`apart`: both paths make the same ones) and
    the copy of the round to the comm device (the same) are left out."""

    def __init__(self):
        super().__init__()
        self.ns = self.other = self.written = 0
        self._inside = False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        out = func(*args, **(kwargs or {}))
        if not self._inside and not func.is_view and name not in _NO_KERNEL and not name.startswith(("c10d", "_c10d")):
            self.other += 1
            writes = [a for s, a in zip(func._schema.arguments, args, strict=False) if s.alias_info is not None
                      and s.alias_info.is_write]
            self.written += _numel(writes or out)
        return out

    def apart(self, real, counter: str | None = None):
        """``real`` with its insides left out of the count (its calls counted in ``counter``, if any)."""
        def counted(*a, **kw):
            if counter:
                setattr(self, counter, getattr(self, counter) + 1)
            self._inside = True
            try:
                return real(*a, **kw)
            finally:
                self._inside = False
        return counted


def _gathered(rnd, batch) -> bool:
    """Whether ``batch``'s blocks are copied into the op's input (not one view of the round buffer)."""
    blocks = blocks_of(torch.empty(rnd.chunk, device="meta"), batch)
    try:
        blocks.view(-1, *blocks.shape[-2:])
    except RuntimeError:
        return True
    return False


def _train(rank: int, world: int, model_dtype, params: dict, kept: bool, legacy: bool):
    import polyaccel

    engine = polyaccel.initialize(build_model("llama", model_dtype, edge=False), muon_config(1, **params))
    opt = engine.optimizer
    opt.kept_buffers = kept
    if legacy:
        legacy_layout(opt)
        opt._orthogonalized = legacy_orthogonalized.__get__(opt)
    real, calls = opt._orthogonalized, {"ns": 0, "other": 0, "written": 0}

    def counted(*a):
        from polyaccel import ops

        mode = Calls()
        real_ns, coll = ops.newton_schulz, opt.coll
        ops.newton_schulz = mode.apart(real_ns, "ns")
        coll.reduce_scatter, coll.all_gather = mode.apart(coll.reduce_scatter), mode.apart(coll.all_gather)
        try:
            with mode:
                out = real(*a)
        finally:
            ops.newton_schulz = real_ns
            del coll.reduce_scatter, coll.all_gather
        calls["ns"] += mode.ns
        calls["other"] += mode.other
        calls["written"] += mode.written
        return out
    opt._orthogonalized = counted
    losses = []
    try:
        for step in range(STEPS):
            loss = loss_of(engine, global_batch(step, world)[rank * 2:(rank + 1) * 2])
            engine.backward(loss)
            assert engine.step() is True
            losses.append(loss.item())
        state = {k: v.detach().clone() for k, v in engine.full_state_dict().items()}
        momentum = opt.state["exp_avg"].detach().clone()
        owned = [(r, b) for r in opt.rounds for b in r.batches if b.owner == opt.coll.rank]
        info = {"rounds": len(opt.rounds), "orthogonalized": opt.orthogonalized, **calls, "batches": len(owned),
                "gathered": sum(_gathered(r, b) for r, b in owned), "cast": opt.buffer_dtype != opt.mcfg.ns_dtype,
                "elements": sum(2 * b.numel * _gathered(r, b) for r, b in owned)}
    finally:
        engine.destroy()
    return losses, state, momentum, info


#: name: (model dtype, Muon params, kept buffers, bit for bit)
CASES = {
    "fp32 model, bf16 iteration, per head": (torch.float32, {"ns_dtype": "bf16", "per_head": True}, False, True),
    "fp32 model, bf16 iteration, whole": (torch.float32, {"ns_dtype": "bf16"}, False, True),
    "fp32 model, fp16 iteration, per head": (torch.float32, {"ns_dtype": "fp16", "per_head": True}, False, True),
    "bf16 model, bf16 iteration, per head": (torch.bfloat16, {"ns_dtype": "bf16", "per_head": True}, False, True),
    "fp32 model, bf16 iteration, per head, kept buffers": (torch.float32, {"ns_dtype": "bf16", "per_head": True},
                                                           True, True),
    # one round: both column-split o_proj matrices in one owner's batch, gathered by a copy (a 4-D view)
    "fp32 model, bf16 iteration, per head, one round": (torch.float32, {"ns_dtype": "bf16", "per_head": True,
                                                                       "gather": 1 << 20}, False, True),
    # the previous path handed the op tall blocks transposed into a contiguous batch (but for a matrix alone in its
    # wide shape), the new one in their own orientation (the op transposes): the host's fp32 GEMMs of a transposed
    # operand round apart
    "fp32 model, fp32 iteration, per head": (torch.float32, {"ns_dtype": "fp32", "per_head": True}, False, False),
}


def run_cases(rank: int, world: int) -> dict:
    torch.set_num_threads(1)
    return {name: (_train(rank, world, dtype, params, kept, False), _train(rank, world, dtype, params, kept, True))
            for name, (dtype, params, kept, _) in CASES.items()}


def _check(results: dict, world: int) -> list[str]:
    """Every case's new run against its previous-path run (one rank's results); a report line each."""
    report = []
    for name, (new, old) in results.items():
        if CASES[name][3]:
            assert new[0] == old[0], f"world {world}, {name}: losses differ"
            for key, want in old[1].items():
                assert torch.equal(new[1][key], want), f"world {world}, {name}: {key} differs from the previous path"
            assert torch.equal(new[2], old[2]), f"world {world}, {name}: the momentum differs"
        else:  # within the fp32 iteration's rounding (1e-6 of an update of lr 0.02): a misplaced block is not
            assert new[0] == pytest.approx(old[0], rel=1e-6), f"world {world}, {name}: losses differ"
            for key, want in old[1].items():
                torch.testing.assert_close(new[1][key], want, rtol=0, atol=1e-6,
                                           msg=lambda m, k=key, n=name: f"world {world}, {n}, {k}: {m}")
            torch.testing.assert_close(new[2], old[2], rtol=0, atol=1e-6)
        assert new[3]["orthogonalized"] == old[3]["orthogonalized"] > 0, (name, new[3])
        if name.endswith("one round"):
            assert new[3]["rounds"] == 1 and (world > 1 or new[3]["gathered"] == 1), (world, name, new[3])
        else:
            assert new[3]["rounds"] > 1, (world, name, new[3])
        # one op call a batch of the plan (tall and wide apart: more op calls than one per wide shape), with out=
        # the blocks where they are one view (the op writes the result over them: on the cpu plugin the reference
        # copies it in, inside the op; the cuda builder's last launch writes it), else (column-split heads of
        # several matrices) one copy in and one out; the cast to the iteration's dtype, where there is one, aside
        assert new[3]["ns"] == new[3]["batches"] * STEPS >= old[3]["ns"], (world, name, new[3], old[3])
        copies = 2 * new[3]["gathered"] * STEPS
        if not new[3]["cast"]:
            assert new[3]["other"] == copies and new[3]["written"] == new[3]["elements"] * STEPS, (world, name, new[3])
        report.append(f"world {world}, {name}: {new[3]['rounds']} rounds x {STEPS} steps; the owner's part: "
                      f"newton_schulz calls {old[3]['ns']} -> {new[3]['ns']}, other dispatcher calls "
                      f"{old[3]['other']} -> {new[3]['other']}, elements they write {old[3]['written']} -> "
                      f"{new[3]['written']}")
    return report


def test_in_place_batches_take_the_previous_steps(capsys):
    report = _check(run_cases(0, 1), 1)
    ranks = run_ranks(run_cases, 2, timeout=280)
    report += _check(ranks[0], 2)
    _check(ranks[1], 2)  # rank 1's own losses, its momentum partition, its share of the matrices
    with capsys.disabled():
        print("\n" + "\n".join(report))
