"""``polyaccel train --sp S``: the checks before any rank starts, and what each rank feeds its model.

Under sequence parallelism (AutoSP, the ``sequence_parallel`` layer) the ranks of one sequence group hold
one model replica's activations for the same rows, each a contiguous ``1/S`` of every sequence. So the data
is sharded over the data-parallel ranks only (the ranks of a sequence group draw the same rows), each rank
feeds :func:`polyaccel.sequence.split_batch`'s part of the batch, and the loss of the whole sequence is the
sum of the sequence ranks' losses (each is its tokens' loss divided by the whole batch's token count).
"""

from __future__ import annotations

from polyaccel.config_check import Int, check_flag
from polyaccel.errors import ConfigError


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def check_sp(sp: int, nproc: int, tp: int, seq_len: int, num_heads: int, spec=None) -> None:
    """``--sp`` divides what ``--tp`` leaves of the ranks, the sequence length and the heads a tensor rank holds
    (Ulysses attention gives each sequence rank ``heads / (tp x sp)`` whole heads); refused with the numbers
    and the sizes that fit. With ``spec``, AutoSP's own checks also run on the model (on the meta device)."""
    check_flag("--sp", sp, Int(1))
    if sp == 1:
        return
    rest = nproc // tp
    if rest % sp:
        what = f"{nproc} ranks / --tp {tp} = {rest}" if tp > 1 else f"{nproc} ranks"
        raise ConfigError(f"--sp {sp} does not divide the {what} (ranks = data x sequence x tensor); use an --sp "
                          f"among {_divisors(rest)} or change --nproc/--tp")
    if seq_len % sp:
        raise ConfigError(f"--sp {sp} does not divide --seq-len {seq_len} ({seq_len} % {sp} = {seq_len % sp}: each "
                          f"sequence rank holds seq_len / sp tokens); use an --sp among "
                          f"{[d for d in _divisors(seq_len) if rest % d == 0]} or a --seq-len that is a multiple "
                          f"of {sp}")
    local_heads = num_heads // tp
    if local_heads % sp:
        fits = [d for d in _divisors(local_heads) if rest % d == 0 and seq_len % d == 0]
        per = f"--heads {num_heads} / --tp {tp} = {local_heads}" if tp > 1 else f"--heads {num_heads}"
        raise ConfigError(f"--sp {sp} does not divide the attention heads of a tensor rank ({per}; Ulysses "
                          f"attention gives each sequence rank whole heads); use an --sp among {fits} or "
                          f"--heads a multiple of {tp * sp}")
    if spec is not None:
        _check_plan(sp, tp, spec)


def _check_plan(sp: int, tp: int, spec) -> None:
    """AutoSP's plan for the model ``spec`` builds (its attention modules, implementation, heads per tensor rank)."""
    import torch
    from polyaccel.engines.autosp import plan_sequence_parallel

    from .model import build_model

    with torch.device("meta"):
        model = build_model(spec)
    try:
        plan_sequence_parallel(model, {"autosp_size": sp, "seq_dim": 1}, tp)
    except ConfigError as exc:
        raise ConfigError(f"--sp {sp}: {exc}") from None


def batch_coords(engine, rank: int, world: int) -> tuple[int, int]:
    """(batch rank, number of batches): the rows this rank draws. The ranks of one tensor or sequence group share
    their rows; the mesh's ``batch`` dimension counts the distinct batches (``data`` also holds the sequence
    ranks, which are data replicas of every parameter)."""
    mesh = getattr(engine, "mesh", None)
    return (mesh.rank("batch"), mesh.size("batch")) if mesh is not None else (rank, world)


def sequence_coords(engine) -> tuple[int, int]:
    """(sequence rank, sequence size) of this rank on the engine's mesh; ``(0, 1)`` without sequence parallelism."""
    mesh = getattr(engine, "mesh", None)
    if mesh is None or getattr(mesh, "sequence", 1) == 1:
        return 0, 1
    return mesh.rank("sequence"), mesh.size("sequence")


def sp_plan(engine) -> str | None:
    """AutoSP's plan of the model the engine trains, described (None without sequence parallelism)."""
    from polyaccel.engines.autosp import PLAN_ATTR

    module = getattr(engine, "module", None)
    plan = getattr(module, "__dict__", {}).get(PLAN_ATTR)
    return plan.describe() if plan is not None else None


def model_inputs(batch, sp_rank: int, sp: int, device) -> dict:
    """The keyword arguments of one forward for this rank: the batch whole at sp 1, else this sequence rank's
    part of it (global positions, globally shifted labels, the whole batch's token count), on ``device``."""
    inputs = {"input_ids": batch.input_ids, "labels": batch.labels}
    if sp > 1:
        from polyaccel.sequence import split_batch

        inputs = split_batch(inputs, rank=sp_rank, size=sp)
    return {k: v.to(device) for k, v in inputs.items()}
