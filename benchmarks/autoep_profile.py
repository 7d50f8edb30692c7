"""Profile AutoEP's MoE layer (ep 1, bf16, forward + backward) and print where device time goes.

    python benchmarks/autoep_profile.py [--experts 8] [--tokens 32768] [--topk 2] [--rows 25] [--hf] [--fused]

Uses ``autoep_gpu.py``'s block and step (AutoEP's default path: the fused expert ops only where the
registry chooses a plugin's builder of them); ``--hf`` profiles the HF eager block as well,
``--fused`` AutoEP forced onto the plugin's fused expert builders (``autoep_gpu.FusedAutoEP``).
"""

from __future__ import annotations

import argparse

import torch


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--experts", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=32768)
    ap.add_argument("--topk", type=int, default=2)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--ffn", type=int, default=1536)
    ap.add_argument("--rows", type=int, default=25)
    ap.add_argument("--hf", action="store_true", help="profile the HF eager block too")
    ap.add_argument("--fused", action="store_true", help="profile AutoEP on the fused expert builders too")
    args = ap.parse_args()

    import polyaccel
    from autoep_gpu import FusedAutoEP, autoep_block, hf_block, train_step
    from torch.profiler import ProfilerActivity, profile

    acc = polyaccel.get_accelerator()
    device = acc.device()
    eager = hf_block(args.experts, args.topk, args.hidden, args.ffn, "eager", device)
    blocks = {"autoep": autoep_block(eager)}
    if args.fused:
        blocks["autoep fused"] = FusedAutoEP(autoep_block(eager))
    if args.hf:
        blocks["hf eager"] = eager
    g = torch.Generator().manual_seed(1)
    x = torch.randn(1, args.tokens, args.hidden, generator=g).to(device=device, dtype=torch.bfloat16)
    grad = torch.randn(1, args.tokens, args.hidden, generator=g).to(device=device)
    on_gpu = device.type == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if on_gpu else [])
    for name, block in blocks.items():
        step = train_step(block, x, grad)
        for _ in range(3):
            step()
        acc.synchronize()
        with profile(activities=activities) as prof:
            for _ in range(5):
                step()
            acc.synchronize()
        print(f"== {name}: E={args.experts} T={args.tokens} k={args.topk} (5 steps)")
        sort = "self_cuda_time_total" if on_gpu else "self_cpu_time_total"
        print(prof.key_averages().table(sort_by=sort, row_limit=args.rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
