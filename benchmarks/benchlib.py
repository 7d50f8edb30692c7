"""Shared helpers of the GPU benchmarks: result rows, timing, the measured ceilings.

Contract for ``benchmarks/bench_<name>.py`` modules (``run_all.py`` runs every one of them in
one process): a function ``main(argv=None) -> list[Row]`` that measures the baseline and
polyaccel in the same process and returns one :class:`Row` per comparison; and, at the end,
``if __name__ == "__main__": benchlib.run_standalone(main)`` so the module also runs alone.
Use :func:`copy_bandwidth_gbs` and :func:`matmul_tflops` as ceilings (measured once per process,
in the same run), and :func:`time_ms` to time (median of CUDA-event timings, warmed up).
"""

from __future__ import annotations

import functools
import math
import sys
import traceback
from collections.abc import Callable
from dataclasses import asdict, dataclass, field

import torch


@dataclass
class Row:
    """One comparison: baseline vs ours on one metric, with the target and whether it is met."""

    bench: str  # module short name, e.g. "optimizers"
    case: str  # what was measured, e.g. "FusedAdam fp32, 256M params / 200 tensors"
    metric: str  # unit of baseline/ours: "ms", "GB/s", "TFLOP/s", "s"
    baseline_name: str
    baseline: float | None
    ours: float | None
    higher_is_better: bool = False
    target: str = ""  # human statement of the target, e.g. ">= 1.10x torch, >= 90% of copy"
    met: bool | None = None  # None: informational row without a target
    detail: str = ""  # extra numbers: GB/s, % of ceiling, bytes counted
    extra: dict = field(default_factory=dict)

    @property
    def ratio(self) -> float | None:
        """Speed-up of ours over the baseline (> 1: ours is better), whatever the unit."""
        if not self.baseline or not self.ours:
            return None
        return self.ours / self.baseline if self.higher_is_better else self.baseline / self.ours

    def as_dict(self) -> dict:
        d = asdict(self)
        d["ratio"] = self.ratio
        return d


def error_row(bench: str, case: str, exc: BaseException) -> Row:
    return Row(bench=bench, case=case, metric="-", baseline_name="-", baseline=None, ours=None, met=False,
               detail=f"ERROR {type(exc).__name__}: {exc}")


def failed_row(bench: str, case: str, exc: BaseException) -> Row:
    """:func:`error_row` for a case that should have run, with the traceback of the exception being handled
    printed (a benchmark reports the other cases and still shows where this one broke)."""
    traceback.print_exc()
    return error_row(bench, case, exc)


def run_parts(bench: str, parts: dict[str, Callable[[list[Row]], None]], only: str | None,
              out: str | None) -> list[Row]:
    """Each part (or only ``only``) appends its rows; a part that raises becomes a :func:`failed_row` and the
    others still run. The rows are written to ``out`` as JSON when given."""
    rows: list[Row] = []
    for name, part in parts.items():
        if only in (None, name):
            try:
                part(rows)
            except Exception as exc:  # noqa: BLE001 - one part failing still reports the others
                rows.append(failed_row(bench, name, exc))
    if out:
        write_json(rows, out)
    return rows


def require_gpu() -> torch.device:
    if not torch.cuda.is_available():
        raise SystemExit("these benchmarks need a CUDA/ROCm GPU (torch.cuda.is_available() is False)")
    return torch.device("cuda", torch.cuda.current_device())


def time_ms(fn: Callable[[], object], warmup_ms: float = 25, rep_ms: float = 200) -> float:
    """Median time of ``fn`` in milliseconds, CUDA events, after warm-up (triton's do_bench)."""
    from triton.testing import do_bench

    return float(do_bench(fn, warmup=warmup_ms, rep=rep_ms, return_mode="median"))


def time_host_s(fn: Callable[[], object], repeats: int = 3) -> float:
    """Median wall-clock seconds of a host-side call (synchronising the device around it)."""
    import time

    out = []
    for _ in range(repeats):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        out.append(time.perf_counter() - t0)
    return sorted(out)[len(out) // 2]


@functools.cache
def copy_bandwidth_gbs(nbytes: int = 4 << 30) -> float:
    """Device-to-device copy bandwidth (bytes read + written per second / 1e9): the memory ceiling."""
    n = nbytes // 4
    bufs = [torch.randn(n, device="cuda"), torch.empty(n, device="cuda")]
    ms = time_ms(lambda: bufs[1].copy_(bufs[0]))
    bufs.clear()
    torch.cuda.empty_cache()
    return 2 * nbytes / (ms * 1e-3) / 1e9


@functools.cache
def matmul_tflops(n: int = 8192, dtype: torch.dtype = torch.bfloat16) -> float:
    """Dense matmul rate on random data: the arithmetic ceiling."""
    ab = [torch.randn(n, n, device="cuda", dtype=dtype) for _ in range(2)]
    ms = time_ms(lambda: ab[0] @ ab[1])
    ab.clear()
    torch.cuda.empty_cache()
    return 2 * n**3 / (ms * 1e-3) / 1e12


def gbs(nbytes: float, ms: float) -> float:
    return nbytes / (ms * 1e-3) / 1e9


def fmt(x: float | None, digits: int = 3) -> str:
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "-"
    return f"{x:.{digits}g}" if abs(x) < 1000 else f"{x:.0f}"


def device_name() -> str:
    if not torch.cuda.is_available():
        return "no GPU"
    p = torch.cuda.get_device_properties(torch.cuda.current_device())
    return f"{p.name} ({p.total_memory / 2**30:.0f} GiB, {p.multi_processor_count} SMs)"


def print_rows(rows: list[Row], title: str = "polyaccel benchmarks") -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=title, show_lines=False)
    for col in ("bench", "case", "unit", "baseline", "base", "ours", "ratio", "target", "status", "detail"):
        table.add_column(col, overflow="fold")
    for r in rows:
        status = "-" if r.met is None else ("[green]met[/]" if r.met else "[red]gap[/]")
        table.add_row(r.bench, r.case, r.metric, r.baseline_name, fmt(r.baseline), fmt(r.ours),
                      "-" if r.ratio is None else f"{r.ratio:.2f}x", r.target, status, r.detail)
    Console(width=200).print(table)


def write_json(rows: list[Row], path: str, **meta) -> None:
    import datetime

    from polyaccel import safe_files

    doc = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "device": device_name(),
        "torch": torch.__version__,
        "torch_cuda": getattr(torch.version, "cuda", None),
        "command": " ".join(sys.argv),
        **meta,
        "rows": [r.as_dict() for r in rows],
    }
    try:
        import triton

        doc["triton"] = triton.__version__
    except Exception:  # noqa: BLE001
        doc["triton"] = None
    safe_files.write_json(path, doc, indent=2)


def run_standalone(main: Callable[..., list[Row]]) -> None:
    rows = main(sys.argv[1:])
    print_rows(rows)
