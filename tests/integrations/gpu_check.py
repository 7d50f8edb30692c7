"""The three integrations on one GPU with the plugin polyaccel selects there (cuda on an NVIDIA machine); run by hand.

    python tests/integrations/gpu_check.py --out result.json [--skip-deepspeed-native] [--only deepspeed]

Not a pytest module (CI has no GPU). One process, world size 1:

1. transformers: the optimizer path (``fused_optimizer``) against ``torch.optim.AdamW``, and
   ``PolyaccelTrainer`` at ZeRO-2 and ZeRO-3 against the engine driven by hand on the same batches;
2. Lightning: ``accelerator="polyaccel"`` with Lightning's default one-device strategy (which Lightning
   creates on "cpu": the accelerator must move it to the GPU), and ``PolyaccelStrategy(stage=3)``
   against the engine driven by hand;
3. DeepSpeed (when importable), each run in its own process: ``install()`` then ``deepspeed.initialize`` with
   ZeRO-2 (FusedAdam on the device) and with ZeRO-3 and ``offload_optimizer: cpu`` (DeepSpeedCPUAdam, served by
   polyaccel's host Adam), against DeepSpeed's own runs of both (its JIT-built FusedAdam and CPU Adam): losses,
   ``deepspeed.initialize`` time and the median step time side by side.

Everything is written to ``--out`` as JSON; the script exits non-zero when a comparison fails.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
import traceback

VOCAB, SEQ, MICRO, STEPS = 61, 12, 2, 6


def tiny_llama(dtype):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
                      tie_word_embeddings=False, use_cache=False)
    return LlamaForCausalLM(cfg).to(dtype)


def token_ids(n=24):
    import torch

    g = torch.Generator().manual_seed(123)
    start = torch.randint(0, VOCAB, (n, 1), generator=g)
    stride = torch.randint(1, 5, (n, 1), generator=g)
    return (start + stride * torch.arange(SEQ)[None, :]) % VOCAB


def hand_engine(model, config, batches, device, lm_forward):
    import polyaccel

    engine = polyaccel.initialize(model, config=config)
    losses = []
    for ids in batches:
        ids = ids.to(device)
        loss = lm_forward(engine, ids)
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    engine.destroy()
    return losses


def check_transformers(res, tmp):
    import polyaccel
    import torch
    from polyaccel.integrations.transformers import PolyaccelTrainer, fused_optimizer
    from transformers import Trainer, TrainingArguments

    ids = token_ids()

    class Data(torch.utils.data.Dataset):
        def __len__(self):
            return len(ids)

        def __getitem__(self, i):
            return {"input_ids": ids[i], "labels": ids[i]}

    def args(name, **kw):
        return TrainingArguments(output_dir=os.path.join(tmp, name), per_device_train_batch_size=MICRO,
                                 max_steps=STEPS, learning_rate=1e-2, lr_scheduler_type="constant",
                                 logging_steps=1, save_strategy="no", report_to="none", seed=0, disable_tqdm=True,
                                 dataloader_drop_last=True, **kw)

    def recording(cls):
        class Rec(cls):
            def training_step(self, model, inputs, num_items_in_batch=None):
                self.__dict__.setdefault("rec_losses", []).append(None)
                self.__dict__.setdefault("rec_batches", []).append(inputs["input_ids"].detach().cpu().clone())
                loss = super().training_step(model, inputs, num_items_in_batch)
                self.rec_losses[-1] = loss.item()
                return loss
        return Rec

    out = {}
    losses = {}
    for name in ("polyaccel", "torch"):
        a = args(f"opt-{name}")
        kw = {"optimizer_cls_and_kwargs": fused_optimizer(a)} if name == "polyaccel" else {}
        t = recording(Trainer)(model=tiny_llama(torch.float32), args=a, train_dataset=Data(), **kw)
        t.train()
        losses[name] = t.rec_losses
    chosen = [ln.strip() for ln in polyaccel.ops.explain("fused_adam").splitlines() if ln.strip().startswith("->")]
    out["optimizer_path"] = {"losses": losses, "builder": chosen,
                             "max_diff": max(abs(x - y) for x, y in zip(losses["polyaccel"], losses["torch"],
                                                                        strict=True))}
    acc = polyaccel.get_accelerator()
    for stage in (2, 3):
        t = recording(PolyaccelTrainer)(model=tiny_llama(torch.float32), args=args(f"engine{stage}"),
                                        train_dataset=Data(), polyaccel_config={"zero_optimization": {"stage": stage}})
        t.train()
        eng = t.polyaccel_engine
        info = {"device": str(eng.device), "builder": eng.optimizer_builder, "losses": t.rec_losses}
        cfg = t.polyaccel_config
        eng.destroy()
        info["hand_losses"] = hand_engine(tiny_llama(torch.float32), cfg, t.rec_batches, acc.device(),
                                          lambda e, x: e(input_ids=x, labels=x).loss)
        info["equal"] = info["losses"] == info["hand_losses"]
        out[f"engine_stage{stage}"] = info
    res["transformers"] = out


def check_lightning(res, tmp):
    import lightning.pytorch as pl
    import polyaccel
    import torch
    from polyaccel.integrations.lightning import PolyaccelStrategy, register

    register()  # accelerator="polyaccel" with Lightning's default strategy: the name must be known first

    class LM(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.lm = tiny_llama(torch.float32)
            self.losses, self.batches, self.devices_seen = [], [], set()

        def forward(self, ids):
            return self.lm(input_ids=ids, labels=ids).loss

        def training_step(self, batch, batch_idx):
            self.devices_seen.add(str(batch.device))
            self.batches.append(batch.detach().cpu().clone())
            loss = self(batch)
            self.losses.append(loss.item())
            return loss

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=1e-2, weight_decay=0.01)

    out = {}
    for name, strategy in (("default_strategy", "auto"), ("polyaccel_stage3", PolyaccelStrategy(stage=3))):
        m = LM()
        t = pl.Trainer(accelerator="polyaccel", devices=1, strategy=strategy, max_steps=STEPS, logger=False,
                       enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False,
                       default_root_dir=os.path.join(tmp, name))
        t.fit(m, torch.utils.data.DataLoader(token_ids(), batch_size=MICRO))
        info = {"strategy": type(t.strategy).__name__, "root_device": str(t.strategy.root_device),
                "batch_devices": sorted(m.devices_seen), "losses": m.losses}
        if name == "polyaccel_stage3":
            eng = t.strategy.polyaccel_engine
            cfg = t.strategy.polyaccel_config
            info["builder"] = eng.optimizer_builder
            eng.destroy()
            info["hand_losses"] = hand_engine(LM(), cfg, m.batches, polyaccel.get_accelerator().device(),
                                              lambda e, x: e(x))
            info["equal"] = info["losses"] == info["hand_losses"]
        out[name] = info
    res["lightning"] = out


DS_LAYOUTS = ("zero2", "zero3_offload")


def ds_config(layout: str) -> dict:
    zero: dict = {"stage": 2}
    if layout == "zero3_offload":
        zero = {"stage": 3, "offload_optimizer": {"device": "cpu", "pin_memory": True}}
    return {"train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": 1, "gradient_clipping": 1.0,
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "betas": [0.9, 0.95], "eps": 1e-8,
                                                      "weight_decay": 0.01}},
            "zero_optimization": zero}


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def ds_train(mode: str, layout: str = "zero2") -> dict:
    import torch

    os.environ.update({"MASTER_ADDR": "127.0.0.1", "RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0",
                       "MASTER_PORT": str(_free_port())})
    info = {"layout": layout}
    if mode == "polyaccel":
        import polyaccel
        import polyaccel.integrations.deepspeed as pds

        pds.install()
        info["polyaccel_plugin"] = polyaccel.get_accelerator().name
    import deepspeed
    from deepspeed.accelerator import get_accelerator

    acc = get_accelerator()
    info.update(ds_accelerator=type(acc).__name__, device=acc.current_device_name(),
                backend=acc.communication_backend_name())
    deepspeed.init_distributed(dist_backend=acc.communication_backend_name())
    model = tiny_llama(torch.float32)
    t0 = time.time()
    engine, opt, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                             config=ds_config(layout))
    info["initialize_s"] = round(time.time() - t0, 1)
    info["zero_optimizer"] = type(opt).__name__
    info["optimizer"] = type(opt.optimizer).__module__ + "." + type(opt.optimizer).__name__
    losses, times = [], []
    ids = token_ids()
    for step in range(STEPS):
        x = ids[step * MICRO:(step + 1) * MICRO].to(engine.device)
        acc.synchronize()
        t0 = time.perf_counter()
        loss = engine(input_ids=x, labels=x).loss
        engine.backward(loss)
        engine.step()
        acc.synchronize()
        times.append(time.perf_counter() - t0)
        losses.append(loss.item())
    info["losses"] = losses
    info["step_ms_median"] = round(1000 * sorted(times[1:])[len(times[1:]) // 2], 2)  # after the first step
    if mode == "polyaccel":
        info["fused_adam_calls"] = pds.FusedAdamOp.calls
        info["cpu_adam_calls"] = pds.CPUAdamOp.calls
        info["explain"] = polyaccel.ops.explain("fused_adam", acc.device_name())
        info["explain_host"] = polyaccel.ops.explain("fused_adam", "cpu")
    engine.destroy()
    return info


def _ds_subprocess(mode: str, layout: str, path: str) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK")}
    proc = subprocess.run([sys.executable, __file__, "--ds-run", mode, layout, path], capture_output=True,
                          text=True, timeout=1200, env=env)
    if proc.returncode != 0:
        return {"failed": proc.stdout[-2000:] + proc.stderr[-4000:]}
    with open(path) as f:
        return json.load(f)


def check_deepspeed(res, tmp, native: bool):
    try:
        import deepspeed  # noqa: F401
    except ImportError as exc:
        res["deepspeed"] = {"skipped": f"deepspeed not importable: {exc}"}
        return
    out: dict = {}
    for layout in DS_LAYOUTS:
        row = {"polyaccel": _ds_subprocess("polyaccel", layout, os.path.join(tmp, f"pa-{layout}.json"))}
        if "failed" in row["polyaccel"]:
            out["error"] = f"polyaccel {layout} failed"
        elif layout == "zero3_offload" and not row["polyaccel"]["cpu_adam_calls"]:
            out["error"] = "zero3_offload: DeepSpeedCPUAdam did not step through polyaccel"
        if native:
            row["native"] = _ds_subprocess("deepspeed", layout, os.path.join(tmp, f"ds-{layout}.json"))
            if "losses" in row["native"] and "losses" in row["polyaccel"]:
                a, b = row["polyaccel"]["losses"], row["native"]["losses"]
                row["max_diff"] = max(abs(x - y) for x, y in zip(a, b, strict=True))
                if row["max_diff"] > 1e-4 * max(abs(x) for x in b):
                    out["error"] = f"{layout}: losses differ from DeepSpeed's own by {row['max_diff']:.3g}"
                row["step_ms"] = {"polyaccel": row["polyaccel"]["step_ms_median"],
                                  "deepspeed": row["native"]["step_ms_median"]}
                row["initialize_s"] = {"polyaccel": row["polyaccel"]["initialize_s"],
                                       "deepspeed": row["native"]["initialize_s"]}
        out[layout] = row
    res["deepspeed"] = out


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--out", default="gpu_check.json")
    p.add_argument("--skip-deepspeed-native", action="store_true")
    p.add_argument("--only", choices=("transformers", "lightning", "deepspeed"), action="append",
                   help="run only these parts (default: all)")
    p.add_argument("--ds-run", nargs=3, metavar=("MODE", "LAYOUT", "OUT"), default=None, help=argparse.SUPPRESS)
    a = p.parse_args()
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    if a.ds_run:
        mode, layout, path = a.ds_run
        with open(path, "w") as f:
            json.dump(ds_train(mode, layout), f)
        return 0
    import polyaccel
    import torch

    res = {"torch": torch.__version__, "accelerator": polyaccel.get_accelerator().name,
           "device": str(polyaccel.get_accelerator().device())}
    with tempfile.TemporaryDirectory() as tmp:
        for name, fn in (("transformers", check_transformers), ("lightning", check_lightning)):
            if a.only and name not in a.only:
                continue
            try:
                fn(res, tmp)
            except Exception:  # noqa: BLE001 - recorded, reported by the exit code
                res[name] = {"error": traceback.format_exc()}
        try:
            if not a.only or "deepspeed" in a.only:
                check_deepspeed(res, tmp, not a.skip_deepspeed_native)
        except Exception:  # noqa: BLE001
            res["deepspeed"] = {"error": traceback.format_exc()}
    with open(a.out, "w") as f:
        json.dump(res, f, indent=1)
    print(json.dumps(res, indent=1)[:6000])
    bad = [k for k in ("transformers", "lightning", "deepspeed") if "error" in res.get(k, {})]
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
