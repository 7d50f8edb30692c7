"""Rank program for the DeepSpeed integration test, run under torchrun in DeepSpeed's own environment.

``--mode polyaccel``: ``polyaccel.integrations.deepspeed.install(<plugin>)`` then ``deepspeed.initialize``;
``--mode deepspeed``: DeepSpeed alone (its own CPU accelerator and its compiled CPU FusedAdam).
Both train the same tiny Llama (fp32, same seed) on the same batches with ZeRO-2 and FusedAdam (AdamW);
rank 0 writes the per-step losses (mean over ranks) and what ran to ``--out`` as JSON.

``--zero 3 --offload``: ZeRO-3 with ``offload_optimizer: cpu``. Through polyaccel DeepSpeed steps with its
DeepSpeedCPUAdam (the config's AdamW), served by polyaccel's host Adam; DeepSpeed alone steps with a client
``torch.optim.AdamW`` (``zero_force_ds_cpu_optimizer: false``), so its reference needs no JIT build of its CPU Adam.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

VOCAB, SEQ, MICRO = 61, 12, 2


def build_model():
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=16, intermediate_size=24, num_hidden_layers=2,
                      num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=32,
                      tie_word_embeddings=False, use_cache=False)
    return LlamaForCausalLM(cfg)


def batch(step: int, rank: int):
    import torch

    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randint(0, VOCAB, (MICRO, SEQ), generator=g)


def check_cpu_adam_and_lion() -> dict:
    """DeepSpeedCPUAdam and FusedLion through the polyaccel builders against plain torch formulas."""
    import polyaccel
    import torch
    from deepspeed.ops.adam import DeepSpeedCPUAdam
    from deepspeed.ops.lion import FusedLion

    g = torch.Generator().manual_seed(5)
    init = torch.randn(37, generator=g)
    grads = [torch.randn(37, generator=g) for _ in range(3)]
    p1, p2 = torch.nn.Parameter(init.clone()), torch.nn.Parameter(init.clone())
    ds_adam = DeepSpeedCPUAdam([p1], lr=1e-2, betas=(0.9, 0.99), eps=1e-8, weight_decay=0.1, adamw_mode=True)
    ref_adam = torch.optim.AdamW([p2], lr=1e-2, betas=(0.9, 0.99), eps=1e-8, weight_decay=0.1)
    for gr in grads:
        for p, opt in ((p1, ds_adam), (p2, ref_adam)):
            p.grad = gr.clone()
            opt.step()
    p3 = torch.nn.Parameter(init.clone())
    lion = FusedLion([p3], lr=1e-2, betas=(0.9, 0.99), weight_decay=0.1)
    ref, m = init.clone(), torch.zeros_like(init)
    for gr in grads:
        p3.grad = gr.clone()
        lion.step()
        update = torch.sign(0.9 * m + 0.1 * gr)
        ref = ref * (1 - 1e-2 * 0.1) - 1e-2 * update
        m = 0.99 * m + 0.01 * gr
    from polyaccel.integrations import deepspeed as pds

    try:
        ds_adam.ds_opt_adam.adam_rollback(ds_adam.opt_id, 1, 1e-2, 0.9, 0.99, 1e-8, 0.1, True, p1, p1.grad, p1, p1)
        rollback = "no error"
    except polyaccel.Unsupported as exc:
        rollback = str(exc)
    return {"rollback": rollback, "cpu_adam_max_diff": (p1.detach() - p2.detach()).abs().max().item(),
            "lion_max_diff": (p3.detach() - ref).abs().max().item(),
            "cpu_adam_calls": pds.CPUAdamOp.calls, "lion_calls": pds.FusedLionOp.calls}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--mode", choices=("polyaccel", "deepspeed"), required=True)
    p.add_argument("--plugin", default="cpu")
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--out", required=True)
    p.add_argument("--zero", type=int, default=2, choices=(2, 3))
    p.add_argument("--offload", action="store_true", help="offload_optimizer to the host")
    a = p.parse_args()
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    import torch

    torch.set_num_threads(1)
    info: dict = {"mode": a.mode}
    if a.mode == "polyaccel":
        import polyaccel
        import polyaccel.integrations.deepspeed as pds

        ds_acc = pds.install(a.plugin)
    import deepspeed
    import torch.distributed as dist
    from deepspeed.accelerator import get_accelerator

    acc = get_accelerator()
    info.update(ds_accelerator=type(acc).__name__, device_name=acc.device_name(),
                comm_backend=acc.communication_backend_name())
    if a.mode == "polyaccel":
        info["is_installed_accelerator"] = acc is ds_acc
        info["polyaccel_plugin"] = acc.polyaccel.name
        from deepspeed.ops import op_builder
        from deepspeed.ops.adam import fused_adam

        info["builders"] = {"op_builder.FusedAdamBuilder": op_builder.FusedAdamBuilder.__module__,
                            "fused_adam.FusedAdamBuilder": fused_adam.FusedAdamBuilder.__module__,
                            "op_builder.CPUAdamBuilder": op_builder.CPUAdamBuilder.__module__,
                            "op_builder.FusedLionBuilder": op_builder.FusedLionBuilder.__module__}
        try:
            op_builder.TransformerBuilder().load()
        except ValueError as exc:
            info["not_implemented_message"] = str(exc)
        info.update(check_cpu_adam_and_lion())
    deepspeed.init_distributed(dist_backend=acc.communication_backend_name())
    rank, world = dist.get_rank(), dist.get_world_size()
    config = {
        "train_micro_batch_size_per_gpu": MICRO,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": 1.0,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "betas": [0.9, 0.95], "eps": 1e-8,
                                                  "weight_decay": 0.01}},
        "zero_optimization": {"stage": a.zero},
    }
    if a.offload:
        config["zero_optimization"]["offload_optimizer"] = {"device": "cpu"}
    model = build_model()
    client = None
    if a.offload and a.mode == "deepspeed":  # torch's AdamW on the host: DeepSpeed's CPU Adam would JIT-build
        params = config.pop("optimizer")["params"]
        client = torch.optim.AdamW(model.parameters(), lr=params["lr"], betas=tuple(params["betas"]),
                                   eps=params["eps"], weight_decay=params["weight_decay"])
        config["zero_force_ds_cpu_optimizer"] = False
    engine, optimizer, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config,
                                                   optimizer=client)
    info["optimizer"] = f"{type(optimizer.optimizer).__module__}.{type(optimizer.optimizer).__name__}"
    info["zero_optimizer"] = type(optimizer).__name__
    losses = []
    for step in range(a.steps):
        ids = batch(step, rank).to(engine.device)
        loss = engine(input_ids=ids, labels=ids).loss
        engine.backward(loss)
        engine.step()
        reported = loss.detach().double().clone()
        dist.all_reduce(reported)
        losses.append(reported.item() / world)
    info["losses"] = losses
    if a.mode == "polyaccel":
        info["polyaccel_fused_adam_calls"] = pds.FusedAdamOp.calls
        info["polyaccel_cpu_adam_calls"] = pds.CPUAdamOp.calls - info["cpu_adam_calls"]  # in training
        info["explain"] = polyaccel.ops.explain("fused_adam", "cpu")
        info["chosen_builder"] = getattr(polyaccel.ops.resolve("fused_adam", "cpu"), "__name__", "")
    engine.destroy()  # ZeRO-3 may abort at interpreter exit without it
    dist.barrier()
    if rank == 0:
        with open(a.out, "w") as f:
            json.dump(info, f)
    dist.destroy_process_group()


def exit_before_finalization() -> None:
    """Leave without Python's finalization, once every rank has its results and the group is destroyed.

    DeepSpeed's objects hold its gloo groups in reference cycles that only the interpreter's last collection frees, so
    the groups' worker threads outlive Python's own state. A worker that finishes the last barrier drops the
    collectives it held, and with them the last reference to a tensor whose Python object is still alive; that decref
    takes the GIL, which a finalizing interpreter refuses by ending the thread, and ending a thread inside a C++
    destructor aborts the rank ("terminate called without an active
    exception"; seen in both modes, mostly on the rank that does not write the results). Nothing under test runs
    after this point."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
    exit_before_finalization()
