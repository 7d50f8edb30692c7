"""Count the Triton compiles ``polyaccel conformance --accelerator cuda`` triggers, on the CPU.

    python benchmarks/conformance_compiles.py [--ops rope,kl] [--rows] [--json out.json]

With an empty Triton cache, a run compiles one binary per distinct (kernel, specialization,
launch options) it launches: the specialization is the kernel's argument types (a tensor's
dtype, an integer's width), whether each pointer is 16-byte aligned and each integer a
multiple of 16 or equal to 1, and every ``tl.constexpr`` value (tiles, flags); an autotuned
kernel compiles each of its configs the first time it sees a tuning key. This script runs the
op checks of the conformance suite (``test_ops.py``: every builder of the cuda plugin, every
dtype the op is defined for) on CPU tensors under ``TRITON_INTERPRET=1``, computes for every
launch the key Triton's JIT would compute on the GPU (Triton's own binder and specialization
function) and counts the distinct keys, per op and in all, in the order the suite runs.

What the CPU cannot mirror: kernels that pick a different tile or flag under the interpreter
(the multi-tensor optimizers' chunk size, the bf16 upcast of the dot kernels) have the same
*number* of variants there, not the same values; registry look-ups inside a builder are sent
to the builder an H100 would choose, as all cuda builders are compatible there. Compile
*time* is not measured here (a ``tl.dot`` kernel takes several times an elementwise one):
``--rows`` prints each row's new keys by kernel, to see where they come from.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections import defaultdict
from contextlib import contextmanager

os.environ["TRITON_INTERPRET"] = "1"  # before any kernel module is imported

import torch  # noqa: E402
import triton  # noqa: E402
from triton.backends.compiler import BaseBackend  # noqa: E402
from triton.runtime import autotuner as _autotuner  # noqa: E402
from triton.runtime import interpreter as _interpreter  # noqa: E402
from triton.runtime.jit import JITFunction, create_function_from_signature  # noqa: E402

#: launch options Triton's NVIDIA backend fills in when a launch leaves them out
DEFAULT_OPTIONS = {"num_warps": 4, "num_stages": 3}


class CompileCounter:
    """Distinct launch keys, each with the row that first needed it."""

    def __init__(self):
        self.first_row: dict[tuple, str] = {}
        self.row = "-"
        self.dry = False
        self._binders: dict = {}
        self._tuned: set = set()

    def _binder(self, fn):
        binder = self._binders.get(fn)
        if binder is None:
            jf = JITFunction(fn)
            binder = self._binders[fn] = create_function_from_signature(jf.signature, jf.params, BaseBackend)
        return binder

    def record(self, fn, args, kwargs) -> None:
        launch = {k: v for k, v in kwargs.items() if k not in ("grid", "warmup")}
        _, spec, options = self._binder(fn)(*args, **launch)
        opts = {k: options.get(k, v) if options.get(k) is not None else v for k, v in DEFAULT_OPTIONS.items()}
        key = (f"{fn.__module__}.{fn.__qualname__}", tuple(str(s) for s in spec), tuple(sorted(opts.items())))
        self.first_row.setdefault(key, self.row)

    def tuning_key_is_new(self, tuner, args, kwargs) -> bool:
        """The autotuner benchmarks (so compiles) every config the first time it sees a tuning key."""
        named = {**dict(zip(tuner.arg_names, args, strict=False)), **kwargs}
        named = {k: v for k, v in named.items() if k in tuner.arg_names}
        key = (id(tuner), tuple(named.get(k) for k in tuner.keys),
               tuple(str(v.dtype) for v in named.values() if hasattr(v, "dtype")))
        new = key not in self._tuned
        self._tuned.add(key)
        return new

    @contextmanager
    def dry_run(self, on: bool):
        before, self.dry = self.dry, on
        try:
            yield
        finally:
            self.dry = before

    def by_row(self) -> dict[str, list[tuple]]:
        out: dict[str, list[tuple]] = defaultdict(list)
        for key, row in self.first_row.items():
            out[row].append(key)
        return out


COUNTER = CompileCounter()


def _install_hooks() -> None:
    run = _interpreter.InterpretedFunction.run

    def counted_run(self, *args, grid, warmup, **kwargs):
        COUNTER.record(self.fn, args, kwargs)
        if COUNTER.dry or warmup:
            return None
        return run(self, *args, grid=grid, warmup=warmup, **kwargs)

    def tuned_run(self, *args, **kwargs):
        # a new tuning key compiles every config (later calls one, the winner: the first stands in)
        configs = self.configs if COUNTER.tuning_key_is_new(self, args, kwargs) else self.configs[:1]
        for i, cfg in enumerate(configs):
            with COUNTER.dry_run(COUNTER.dry or i > 0):
                self.fn.run(*args, **kwargs, **{k: v for k, v in cfg.all_kwargs().items() if v is not None})

    _interpreter.InterpretedFunction.run = counted_run
    _autotuner.Autotuner.run = tuned_run


def _gpu_choice(registry):
    """``resolve`` for the CPU as an H100 would answer for cuda: the highest-priority builder serving cuda."""
    cache = {}

    def resolve(op, device_type):
        if op not in cache:
            cands = [b for b in registry.builders(op) if b.serves("cuda")]
            cache[op] = max(cands, key=lambda b: b.priority).load()
        return cache[op]

    return resolve


def _tuned_on_gpu():
    """Launchers that skip their autotuner under the interpreter take it here (one config runs)."""
    import importlib

    for name in ("moe_experts",):
        try:
            mod = importlib.import_module(f"polyaccel.plugins.cuda.kernels.{name}")
        except ImportError:
            continue
        mod.interpreting = lambda: False


def rows(ops_filter):
    """(op, builder name, loaded fn, dtype) in the suite's order: ops sorted, builders by rank, dtypes."""
    from polyaccel.ops import registry
    from polyaccel.testing.conformance import opcases

    for op in registry.ops():
        if op not in opcases.OP_DTYPES or (ops_filter and op not in ops_filter):
            continue
        builders = sorted((b for b in registry.builders(op) if b.plugin == "cuda"), key=lambda b: -b.priority)
        for b in builders:
            for dtype in opcases.OP_DTYPES[op]:
                yield op, b.name, b, dtype


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ops", default="", help="comma-separated ops (default: every op with a check)")
    p.add_argument("--rows", action="store_true", help="print each row's new keys by kernel")
    p.add_argument("--keys", action="store_true", help="print each new key (specialization and options) too")
    p.add_argument("--json", default=None, help="write the counts here")
    args = p.parse_args(argv)

    _install_hooks()
    from polyaccel.runtime import current
    from polyaccel.testing.conformance.test_ops import OpCase, _check

    reg = current().ops
    reg.resolve = _gpu_choice(reg)
    _tuned_on_gpu()
    device = torch.device("cpu")
    per_op: dict[str, int] = defaultdict(int)
    failed = []
    t0 = time.perf_counter()
    for op, name, builder, dtype in rows(set(filter(None, args.ops.split(",")))):
        row = f"{op}/{name}/{str(dtype).removeprefix('torch.')}"
        COUNTER.row = row
        before = len(COUNTER.first_row)
        torch.manual_seed(0)
        t1 = time.perf_counter()
        try:
            _check(OpCase(op, name, "cuda", False, dtype), builder.load(), device, True)
        except Exception as exc:  # noqa: BLE001 - a row the CPU cannot run is reported, the count goes on
            failed.append((row, f"{type(exc).__name__}: {str(exc)[:200]}"))
        new = len(COUNTER.first_row) - before
        per_op[op] += new
        print(f"{row:<58} {new:>3} new compiles ({time.perf_counter() - t1:5.1f} s on the CPU)", flush=True)
        if args.rows or args.keys:
            kinds = defaultdict(list)
            for key in COUNTER.by_row().get(row, []):
                kinds[key[0].rsplit(".", 1)[-1]].append(key)
            for kernel, keys in sorted(kinds.items()):
                print(f"    {kernel}: {len(keys)}")
                for key in keys if args.keys else ():
                    print(f"      {' '.join(key[1])} {dict(key[2])}")
    total = len(COUNTER.first_row)
    print("\nper op:")
    for op, n in sorted(per_op.items()):
        print(f"  {op:<24} {n:>4}")
    kernels = defaultdict(int)
    for key in COUNTER.first_row:
        kernels[key[0]] += 1
    print("per kernel:")
    for kernel, n in sorted(kernels.items()):
        print(f"  {kernel:<70} {n:>4}")
    print(f"total distinct compiles: {total} (counted in {time.perf_counter() - t0:.0f} s; triton "
          f"{triton.__version__})")
    for row, why in failed:
        print(f"could not run on the CPU: {row}: {why}", file=sys.stderr)
    result = {"total": total, "per_op": dict(per_op), "per_kernel": dict(kernels), "failed": failed}
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(result, fh, indent=1)
    return result


if __name__ == "__main__":
    main()
