"""What each rank runs: set up the process, train, save, and (rank 0) report.

Spawned by :mod:`polyaccel.apps.train.launcher` through torchrun's API, so the rendezvous
environment (``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``/``PORT``) is set.
Hardware is reached only through the contracts: the selected accelerator, ``polyaccel.comm``
and the engine returned by ``polyaccel.initialize``.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from pathlib import Path

from torch.distributed.elastic.multiprocessing.errors import record

from .kernels import summary as kernels_summary
from .options import META_PREFIX, TrainOptions, write_checkpoint_meta
from .sequence import batch_coords, model_inputs, sequence_coords, sp_plan


def _quiet_libraries() -> None:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


@record
def rank_main(opts: TrainOptions) -> dict | None:
    """Entry point of one rank; rank 0 returns the run's result dict, the others None."""
    _quiet_libraries()
    import polyaccel
    import torch
    from polyaccel import comm

    polyaccel.set_accelerator(opts.accelerator)
    acc = polyaccel.get_accelerator()
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if acc.device_type != "cpu":
        acc.set_device(local_rank)
    torch.set_num_threads(opts.threads)
    comm.init_distributed()
    try:
        result = train(opts, acc, acc.device(local_rank))
        comm.barrier()
        return result
    finally:
        comm.destroy()


def _checkpoint_meta(opts: TrainOptions, step: int, world_size: int) -> dict:
    return {"step": step, "model": opts.model.as_dict(), "seed": opts.seed, "stage": opts.stage,
            "world_size": world_size, "dtype": opts.dtype, "tp": opts.tp, "ep": opts.ep, "sp": opts.sp}


def save(engine, opts: TrainOptions, step: int, rank: int, world_size: int) -> str:
    """Save a checkpoint tagged ``step<N>``; the run metadata goes first, the engine's ``latest`` last.

    A save that fails (every rank raises the engine's one :class:`CheckpointError`) leaves the save
    directory as it was: the engine removes its staging folder, rank 0 puts back the metadata file
    of the tag (removes it, when the tag is new).
    """
    from polyaccel.engines.zero import raise_if_any_failed, run_id
    from polyaccel.errors import CheckpointError

    tag = f"step{step}"
    meta = {**_checkpoint_meta(opts, step, world_size), "run_id": run_id(engine)}  # (rank 0's is the one written)
    meta_file = Path(opts.save) / f"{META_PREFIX}{tag}.json"
    before = None
    error = None
    if rank == 0:
        try:
            Path(opts.save).mkdir(parents=True, exist_ok=True)
            before = meta_file.read_bytes() if meta_file.is_file() else None
            write_checkpoint_meta(opts.save, tag, meta)
        except OSError as exc:
            error = CheckpointError(f"cannot write {meta_file} ({exc.strerror or exc}); nothing was changed",
                                    meta_file)
    raise_if_any_failed(engine.coll, error, f"saving checkpoint {tag!r} in {opts.save!r} failed")
    try:
        engine.save_checkpoint(opts.save, tag=tag, client_state={"train": meta})
    except CheckpointError:
        if rank == 0:
            _restore(meta_file, before)
        raise
    return tag


def _restore(path: Path, content: bytes | None) -> None:
    """Put ``path`` back as it was before a failed save (``None``: it did not exist)."""
    import contextlib

    from polyaccel.safe_files import write_bytes

    with contextlib.suppress(OSError):
        if content is None:
            path.unlink(missing_ok=True)
        else:
            write_bytes(path, content)


def optimizer_builders(engine, acc, opts: TrainOptions) -> list[dict]:
    """The op builder the engine's AdamW runs on, as the registry chose it for the master weights' device."""
    from polyaccel.ops import registry

    op = "fused_adam"  # the engine config asks for AdamW
    device_type = "cpu" if opts.offload else acc.device_type
    chosen = registry.chosen(op, device_type)
    name = getattr(engine, "optimizer_builder", None) or chosen.name
    builder = chosen if chosen.name == name else next(b for b in registry.builders(op) if b.name == name)
    return [{"op": builder.op, "builder": builder.name, "plugin": builder.plugin, "kind": builder.kind,
             "device_type": device_type}]


def _muon_matrices(engine) -> int | None:
    """How many matrices Muon steps (``--optimizer muon``; None with AdamW)."""
    choices = getattr(engine, "muon_choices", None)
    return None if choices is None else sum(1 for c in choices.values() if c.muon)


def tp_plan_counts(engine) -> dict | None:
    """The AutoTP plan's counts (column / row / vocab / replicated) of the model the engine trains."""
    from polyaccel.engines.autotp import get_plan

    plan = get_plan(engine.module)
    return plan.counts() if plan is not None else None


def ep_summary(engine, device_type: str) -> dict | None:
    """AutoEP's plan (degree, MoE layers, experts) and the grouped_mm builder the experts ran on."""
    from polyaccel.engines.autoep import ep_plan
    from polyaccel.ops import registry

    plan = ep_plan(engine)
    if plan is None:
        return None
    b = registry.chosen("grouped_mm", device_type)
    return {"ep": plan.ep_size, "expert_data": plan.expert_data, "moe_layers": len(plan.layers),
            "experts": plan.layers[0].num_experts if plan.layers else 0,
            "routing": plan.layers[0].routing.describe() if plan.layers else "",
            "grouped_mm": {"builder": b.name, "plugin": b.plugin, "kind": b.kind, "device_type": device_type}}


@dataclass
class _RunLog:
    """What the training loop records: per-step mean losses and times, the checkpoints it saved."""

    losses: list[float] = field(default_factory=list)
    step_times: list[float] = field(default_factory=list)
    saved_tags: list[str] = field(default_factory=list)
    train_s: float = 0.0


def train(opts: TrainOptions, acc, device) -> dict | None:
    """Set up the model and engine, run the loop, save, and (rank 0) return the report."""
    import polyaccel
    from polyaccel import comm

    rank, world = comm.get_rank(), comm.get_world_size()
    t_begin = time.perf_counter()
    model, n_params = _build_model(opts, acc)
    engine = polyaccel.initialize(model.to(device), config=opts.engine_config())
    try:
        if opts.resume:
            _resume(engine, opts)
        log = _train_loop(engine, opts, device, rank, world)
        peak = acc.max_memory_allocated() if acc.has("memory_stats") else None
        if opts.save:
            log.saved_tags.append(save(engine, opts, opts.steps, rank, world))
        if rank != 0:
            return None
        return _report(engine, opts, acc, device, world, n_params, log, peak, t_begin)
    finally:
        destroy = getattr(engine, "destroy", None)
        if destroy is not None:
            destroy()


def _build_model(opts: TrainOptions, acc):
    """The seeded model (its weights from ``init_from`` when given) and its parameter count."""
    import torch

    from .model import build_model, count_parameters

    torch.manual_seed(opts.seed)
    acc.manual_seed(opts.seed)
    model = build_model(opts.model)
    if opts.init_from:  # the full state dict on every rank; the layers cut their pieces out of it
        from safetensors.torch import load_file

        # (names and shapes were checked before spawning; a tied weight left out of the file is its twin)
        model.load_state_dict(load_file(opts.init_from), strict=False)
    return model, count_parameters(model)


def _resume(engine, opts: TrainOptions) -> None:
    """Load the checkpoint to resume from; its step must be the one its metadata file gave."""
    import polyaccel

    from .options import read_checkpoint_meta
    from .run_records import differences

    client_state = engine.load_checkpoint(opts.resume, tag=opts.resume_tag) or {}
    saved = client_state.get("train", {}).get("step")
    if saved != opts.start_step:
        raise polyaccel.PolyaccelError(
            f"checkpoint {opts.resume_tag!r} in {opts.resume} says step {saved}, "
            f"its metadata file says {opts.start_step}; the directory is inconsistent"
        )
    diff = differences(read_checkpoint_meta(opts.resume, opts.resume_tag)[1], client_state.get("train"))
    if diff:  # (checked before spawning too: this catches a file replaced since)
        raise polyaccel.PolyaccelError(f"checkpoint {opts.resume_tag!r} in {opts.resume} and its metadata file come "
                                       f"from two different runs ({'; '.join(diff[:3])}); the directory is "
                                       "inconsistent")


def _train_loop(engine, opts: TrainOptions, device, rank: int, world: int) -> _RunLog:
    """The steps from ``start_step`` to ``steps``, saving every ``save_every`` steps on the way."""
    import torch
    from polyaccel import comm

    from .data import ByteTokenizer, TokenSampler, load_text
    from .progress import TrainProgress

    # the ranks of one tensor or sequence group share their batch: rows go by data rank; each sequence rank
    # feeds its part of every sequence, and the sequence group's losses add up to the whole sequence's
    data_rank, data_world = batch_coords(engine, rank, world)
    sp_rank, sp = sequence_coords(engine)
    sampler = TokenSampler(ByteTokenizer().encode(load_text(opts.text)), opts.seq_len, opts.batch_size, opts.seed)
    log = _RunLog()
    bar = TrainProgress(opts.steps, opts.start_step, opts.log_every, enabled=rank == 0)
    t_train = time.perf_counter()
    with bar:
        for step in range(opts.start_step, opts.steps):
            t0 = time.perf_counter()
            loss_sum = torch.zeros((), dtype=torch.float64, device=device)
            for micro in range(opts.grad_accum):
                batch = sampler.batch(step, micro, data_rank, data_world)
                out = engine(**model_inputs(batch, sp_rank, sp, device))
                engine.backward(out.loss)
                engine.step()
                loss_sum += out.loss.detach().to(torch.float64)
            comm.all_reduce(loss_sum)  # the loss shown is the mean over data ranks and micro-batches
            loss = loss_sum.item() * sp / (world * opts.grad_accum)  # (a sequence group's ranks add up to one)
            dt = time.perf_counter() - t0
            log.losses.append(loss)
            log.step_times.append(dt)
            bar.update(step + 1, loss, opts.tokens_per_step / dt)
            done = step + 1
            if opts.save and opts.save_every and done % opts.save_every == 0 and done < opts.steps:
                log.saved_tags.append(save(engine, opts, done, rank, world))
                bar.note(f"saved checkpoint {log.saved_tags[-1]} in {opts.save}")
    log.train_s = time.perf_counter() - t_train
    return log


def _report(engine, opts: TrainOptions, acc, device, world: int, n_params: int, log: _RunLog, peak,
            t_begin: float) -> dict:
    """Rank 0's result dict of the run."""
    import torch

    return {
        "plugin": acc.name,
        "device_type": acc.device_type,
        "device": str(device),
        "emulated": bool(acc.is_emulated()),
        "comm_backend": str(torch.distributed.get_backend()),
        "world_size": world,
        "threads_per_rank": opts.threads,
        "model": opts.model.as_dict(),
        "parameters": n_params,
        "stage": opts.stage,
        "offload": opts.offload,
        "host_optimizer_share": engine.host_optimizer_share,
        "tp": opts.tp,
        "tp_plan": tp_plan_counts(engine) if opts.tp > 1 else None,
        "ep": opts.ep,
        "ep_plan": ep_summary(engine, acc.device_type),
        "kernels": kernels_summary(engine),
        "sp": opts.sp,
        "sp_plan": sp_plan(engine) if opts.sp > 1 else None,
        "seq_len": opts.seq_len,
        "dtype": opts.dtype,
        "optimizer": opts.optimizer,
        "muon_matrices": _muon_matrices(engine),
        "grad_accum": opts.grad_accum,
        "start_step": opts.start_step,
        "steps": opts.steps,
        "losses": log.losses,
        "step_times_s": log.step_times,
        "tokens_per_step": opts.tokens_per_step,
        "train_s": log.train_s,
        "peak_device_memory_bytes": peak,  # rank 0's; None where the plugin keeps no memory statistics
        "wall_s": time.perf_counter() - t_begin,
        "op_builders": optimizer_builders(engine, acc, opts),
        "checkpoints": [str(Path(opts.save) / t) for t in log.saved_tags] if opts.save else [],
        "resumed_from": f"{opts.resume}:{opts.resume_tag}" if opts.resume else None,
        "init_from": opts.init_from,
    }
