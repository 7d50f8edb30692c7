"""The peers of ``zero_gpu.py``: DeepSpeed's ZeRO and torch FSDP2 on the same model, data and optimizer.

Each function takes a fresh copy of the model (on the host) and the ZeRO section of a row, and
returns ``(step_fn, close)`` or raises :class:`PeerUnavailable` with the reason (not installed,
no equivalent configuration). The process group of one is initialised by ``zero_gpu.py`` first,
so every engine in the process shares it.
"""

from __future__ import annotations

import torch


class PeerUnavailable(Exception):
    pass


def optimizer_step(model, opt, autocast_device=None):
    """``step(ids) -> loss`` of a model trained by a torch optimizer: forward (under bf16 autocast on
    ``autocast_device`` where given), backward, ``opt.step()``, gradients dropped."""
    import contextlib

    def step(ids):
        with (torch.autocast(autocast_device.type, dtype=torch.bfloat16) if autocast_device is not None
              else contextlib.nullcontext()):
            loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.detach()

    return step


def deepspeed_step(model, zero: dict, batch: int, lr: float, wd: float):
    try:
        import deepspeed
    except ImportError as exc:
        raise PeerUnavailable(f"deepspeed not importable ({exc})") from None
    zero = {**zero}
    for key in ("offload_optimizer", "offload_param"):
        if key in zero:  # DeepSpeed's default is pageable staging; its best setting pins, as ours does
            zero[key] = {**zero[key], "pin_memory": True}
    config = {"train_micro_batch_size_per_gpu": batch, "bf16": {"enabled": True}, "zero_optimization": zero,
              "optimizer": {"type": "AdamW", "params": {"lr": lr, "weight_decay": wd}},
              "steps_per_print": 10**9, "wall_clock_breakdown": False}
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)

    def step(ids):
        loss = engine(input_ids=ids, labels=ids).loss
        engine.backward(loss)
        engine.step()
        return loss.detach()

    def close():
        engine.destroy()

    return step, close


def fsdp2_unsupported(zero: dict) -> str | None:
    """Why FSDP2 has no equivalent of this ZeRO row, or None when it has one."""
    offload = "offload_optimizer" in zero
    if zero["stage"] == 1 or (offload and zero["stage"] != 3):
        return "FSDP2 has no equivalent of this row (it shards parameters, or offloads both)"
    if "offload_param" in zero and not offload:
        return "FSDP2 cannot offload parameters without the optimizer"
    return None


def fsdp2_step(model, zero: dict, device, lr: float, wd: float):
    """``fully_shard`` per decoder layer and at the root, bf16 parameters, fp32 gradient reduction;
    stage 2 keeps parameters gathered between forward and backward, stage 3 reshards, and the
    offload rows use ``CPUOffloadPolicy`` (which always moves parameters and optimizer state)."""
    try:
        from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard
    except ImportError as exc:
        raise PeerUnavailable(f"torch FSDP2 not importable ({exc})") from None
    if (why := fsdp2_unsupported(zero)) is not None:
        raise PeerUnavailable(why)
    stage = zero["stage"]
    offload = "offload_optimizer" in zero
    kwargs = {"mp_policy": MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32),
              "reshard_after_forward": stage == 3}
    if offload:
        kwargs["offload_policy"] = CPUOffloadPolicy(pin_memory=True)
    else:
        model = model.to(device)
    for layer in model.model.layers:
        fully_shard(layer, **kwargs)
    fully_shard(model, **kwargs)
    try:
        opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=wd, fused=True)
    except (RuntimeError, TypeError):
        opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=wd)
    return optimizer_step(model, opt), lambda: None
