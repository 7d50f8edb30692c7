"""The end-of-run summary: who did the work (plugin, comm backend, op builders) and how it went."""

from __future__ import annotations

import statistics

from rich.console import Console
from rich.table import Table
from rich.text import Text


def mean_tokens_per_s(result: dict) -> float:
    """Tokens/s over the run, leaving out the first step (warm-up) when there is more than one."""
    times = result["step_times_s"]
    if len(times) > 1:
        times = times[1:]
    return result["tokens_per_step"] / statistics.fmean(times) if times else 0.0


def _tp_rows(result: dict) -> list[tuple[str, str]]:
    tp = result.get("tp", 1)
    if tp <= 1:
        return []
    c = result.get("tp_plan") or {}
    plan = (f"; plan: {c['column']} column, {c['row']} row, {c['vocab']} vocab layers, {c['replicated']} "
            "replicated parameters") if c else ""
    return [("tensor parallel", f"AutoTP: tensor {tp} x data {result['world_size'] // (tp * result.get('sp', 1))}"
                                f"{plan}")]


def _sp_rows(result: dict) -> list[tuple[str, str]]:
    sp = result.get("sp", 1)
    if sp <= 1:
        return []
    data = result["world_size"] // (sp * result.get("tp", 1))
    seq = result.get("seq_len")
    each = f"; {seq // sp} of {seq} tokens per rank" if seq else ""
    plan = f"; {result['sp_plan'].removeprefix('AutoSP: ')}" if result.get("sp_plan") else ""
    return [("sequence parallel", f"AutoSP (Ulysses attention): sequence {sp} x data {data}{each}{plan}")]


def _kernel_rows(result: dict) -> list[tuple[str, str]]:
    k = result.get("kernels")
    if not k:
        return []
    on = [f"{name} x{v['swapped']}" for name, v in k["kernels"].items() if v["on"]]
    left = len(k.get("left_alone") or {})
    text = ", ".join(on) if on else "none swapped"
    return [("model kernels", text + (f"; {left} candidate modules left as Hugging Face's" if left else ""))]


def _ep_rows(result: dict) -> list[tuple[str, str]]:
    p = result.get("ep_plan")
    if not p:
        return []
    g = p["grouped_mm"]
    return [("expert parallel", f"AutoEP: expert {p['ep']} x expert_data {p['expert_data']}; {p['moe_layers']} MoE "
                                f"layers of {p['experts']} experts ({p['experts'] // p['ep']} per rank), "
                                f"{p['routing']}; experts on grouped_mm: {g['builder']} ({g['kind']}, plugin "
                                f"{g['plugin'] or '-'}, on {g['device_type']})")]


def _optimizer_row(result: dict) -> str:
    if result.get("optimizer") == "muon":
        return f"muon ({result.get('muon_matrices')} matrices; AdamW for the rest)"
    return "adamw"


def summary_rows(result: dict) -> list[tuple[str, str]]:
    plugin = result["plugin"] + (" (emulated)" if result.get("emulated") else "")
    offload = "off"
    if result["offload"]:
        offload = "optimizer + params -> cpu" if result["stage"] == 3 else "optimizer -> cpu"
        share = result.get("host_optimizer_share", 1.0)
        if share < 1:
            offload += f" ({share:.0%} of it; the rest on the device)"
    losses = result["losses"]
    builders = ", ".join(
        f"{b['op']}: {b['builder']} ({b['kind']}, plugin {b['plugin'] or '-'}, on {b['device_type']})"
        for b in result["op_builders"]
    )
    m = result["model"]
    rows = [
        ("accelerator plugin", f"{plugin}  [device {result['device']}]"),
        ("comm backend", f"{result['comm_backend']}  ({result['world_size']} ranks, "
                         f"{result['threads_per_rank']} thread(s) each)"),
        ("op builders", builders),
        ("model", f"{m['name']} {m['num_layers']} layers x {m['hidden_size']} hidden, "
                  f"{result['parameters']:,} parameters"),
        ("ZeRO", f"stage {result['stage']}, offload {offload}, dtype {result['dtype']}, "
                 f"grad accum {result['grad_accum']}"),
        ("optimizer", _optimizer_row(result)),
        *_tp_rows(result),
        *_ep_rows(result),
        *_sp_rows(result),
        *_kernel_rows(result),
        ("steps", f"{result['start_step']} -> {result['steps']}"
                  + (f"  (resumed from {result['resumed_from']})" if result.get("resumed_from") else "")),
        ("loss", f"{losses[0]:.4f} -> {losses[-1]:.4f}" if losses else "-"),
        ("throughput", f"{mean_tokens_per_s(result):,.0f} tokens/s  ({result['tokens_per_step']:,} tokens/step, "
                       f"{result['train_s']:.1f} s training)"),
    ]
    if result.get("peak_device_memory_bytes") is not None:
        rows.append(("peak device memory", f"{result['peak_device_memory_bytes'] / 2**20:,.1f} MiB (rank 0)"))
    if result["checkpoints"]:
        rows.append(("checkpoint", result["checkpoints"][-1]))
    return rows


def print_summary(result: dict, console: Console | None = None) -> None:
    console = console or Console()
    table = Table(title="polyaccel train: summary", show_header=False, title_justify="left")
    table.add_column(style="bold")
    table.add_column()
    for key, value in summary_rows(result):
        table.add_row(key, Text(value))  # plain text: values may contain [brackets]
    console.print(table)
