"""Run every ``benchmarks/bench_*.py`` module's ``main()`` in one process on the GPU.

    python benchmarks/run_all.py --out results.json [--only optimizers,graphs] [--skip grouped_mm]

Prints one table of every row (baseline, ours, ratio, target, met or gap) and writes the rows
as JSON to ``--out``. A module that fails is reported as an error row; the others still run.
The device-copy bandwidth and the matmul rate (the ceilings) are measured once, here, in the
same process as every kernel.
"""

from __future__ import annotations

import argparse
import gc
import importlib
import pathlib
import sys
import time

HERE = pathlib.Path(__file__).resolve().parent
if str(HERE) not in sys.path:
    sys.path.insert(0, str(HERE))

import benchlib  # noqa: E402


def discover() -> list[str]:
    return sorted(p.stem[len("bench_"):] for p in HERE.glob("bench_*.py"))


def _names(arg: str | None) -> set[str]:
    return {x.strip() for x in (arg or "").split(",") if x.strip()}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", help="write the rows as JSON to this path")
    ap.add_argument("--only", help="comma-separated bench names (bench_<name>.py) to run")
    ap.add_argument("--skip", help="comma-separated bench names to leave out")
    args = ap.parse_args(argv)

    names = discover()
    only, skip = _names(args.only), _names(args.skip)
    unknown = (only | skip) - set(names)
    if unknown:
        ap.error(f"unknown bench names {sorted(unknown)}; found {names}")
    names = [n for n in names if (not only or n in only) and n not in skip]

    import torch

    benchlib.require_gpu()
    print(f"device: {benchlib.device_name()}  torch {torch.__version__}", flush=True)
    copy = benchlib.copy_bandwidth_gbs()
    mm = benchlib.matmul_tflops()
    rows = [
        benchlib.Row("ceilings", "device-to-device copy, 4 GiB fp32 (read+write)", "GB/s", "-", None, copy,
                     higher_is_better=True, detail="memory ceiling for every bandwidth target"),
        benchlib.Row("ceilings", "bf16 matmul 8192^3, random data", "TFLOP/s", "-", None, mm,
                     higher_is_better=True, detail="arithmetic ceiling"),
    ]
    timings = {}
    for name in names:
        t0 = time.perf_counter()
        print(f"== bench_{name}", flush=True)
        try:
            mod = importlib.import_module(f"bench_{name}")
            got = mod.main([])
            rows.extend(got)
            benchlib.print_rows(got, title=f"bench_{name}")
        except Exception as exc:  # noqa: BLE001 - one failing bench never hides the others
            rows.append(benchlib.failed_row(name, "module failed", exc))
        finally:
            gc.collect()
            torch.cuda.empty_cache()
        timings[name] = round(time.perf_counter() - t0, 1)
        print(f"== bench_{name} took {timings[name]} s", flush=True)
    benchlib.print_rows(rows)
    if args.out:
        benchlib.write_json(rows, args.out, bench_seconds=timings)
        print(f"wrote {args.out}")
    gaps = [r for r in rows if r.met is False]
    print(f"{sum(r.met is True for r in rows)} targets met, {len(gaps)} gaps or errors")
    return 0


if __name__ == "__main__":
    sys.exit(main())
