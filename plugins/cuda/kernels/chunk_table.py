"""Chunk tables: how one multi-tensor kernel launch finds its work among many tensors.

For operand lists ``(params, grads, *states)`` of N tensors, a table holds on the device:

* ``addrs``  int64 [L*N]: the data address of tensor i of list l at ``l*N + i``;
* ``numels`` int64 [N];
* ``first_chunk`` int64 [N+1]: tensor i owns programs ``first_chunk[i] : first_chunk[i+1]``;
* ``chunk_tensor`` / ``chunk_start`` int64 [C]: program c works on tensor ``chunk_tensor[c]``
  from element ``chunk_start[c]`` (64-bit, so tensors above 2**31 elements work).

Tensors are grouped by their dtype combination (one launch per group; normally one group).
Empty tensors get no chunks. Building costs host work and one host-to-device copy, so tables
are cached by the operands' addresses, sizes and dtypes: an optimizer that steps the same
parameters reuses its table, and a CUDA graph captured after one warm-up step replays with
no host work at all.
"""

from __future__ import annotations

import functools
import operator
import os
import threading
from collections import OrderedDict
from dataclasses import dataclass

import torch
from polyaccel.errors import ConfigError, OpArgumentError
from polyaccel.ops.reference.optimizers import check_lists

from ..triton_support import interpreting

_SUPPORTED = (torch.float32, torch.bfloat16, torch.float16)
# unbound accessors: the cache key is built on every call, over every tensor (host time per step)
_ptr, _numel, _dtype = torch.Tensor.data_ptr, torch.Tensor.numel, operator.attrgetter("dtype")
_CACHE_SIZE = 32

#: (BLOCK elements per inner step, ITERS inner steps per program, num_warps) by param element size;
#: chosen from launch-configuration sweeps on an H200 (benchmarks/RESULTS.md)
_GPU_CONFIG = {4: (1024, 4, 4), 2: (1024, 4, 4)}
#: the CPU interpreter runs every program in numpy: small chunks keep tests fast and multi-chunk
_INTERPRETER_CONFIG = (32, 2, 1)
_config_override: tuple[int, int, int] | None = None


#: tuning runs set BLOCK,ITERS,WARPS without code changes; read (and refused if malformed) at first use
CONFIG_ENV = "POLYACCEL_TRITON_OPTIM_CONFIG"


def _checked_config(block: int, iters: int | None, num_warps: int | None, what: str) -> tuple[int, int, int]:
    if block & (block - 1) or block < 16:
        raise ConfigError(f"{what}: BLOCK must be a power of two >= 16, got {block}")
    return int(block), int(iters or 1), int(num_warps or 4)


@functools.lru_cache(maxsize=4)
def _parse_env_config(raw: str) -> tuple[int, int, int]:
    try:
        b, i, w = (int(x) for x in raw.split(","))
    except ValueError:
        raise ConfigError(f"{CONFIG_ENV}={raw!r} is not 'BLOCK,ITERS,WARPS'") from None
    return _checked_config(b, i, w, f"{CONFIG_ENV}={raw!r}")


def _forced_config() -> tuple[int, int, int] | None:
    """The configuration set by :func:`set_launch_config`, else by the environment, else None."""
    if _config_override is not None:
        return _config_override
    raw = os.environ.get(CONFIG_ENV)
    return _parse_env_config(raw) if raw else None


def launch_config(param_dtype: torch.dtype = torch.float32) -> tuple[int, int, int]:
    """(BLOCK, ITERS, num_warps) for the elementwise optimizer kernels over params of ``param_dtype``."""
    forced = _forced_config()
    if forced is not None:
        return forced
    if interpreting():
        return _INTERPRETER_CONFIG
    return _GPU_CONFIG.get(param_dtype.itemsize, _GPU_CONFIG[4])


def set_launch_config(block: int | None, iters: int | None = None, num_warps: int | None = None) -> None:
    """Force a launch configuration (benchmarks sweep it; tests shrink it). ``None`` restores the default
    (``POLYACCEL_TRITON_OPTIM_CONFIG`` when set, else the tuned table)."""
    global _config_override
    if block is None:
        _config_override = None
        return
    _config_override = _checked_config(block, iters, num_warps, "set_launch_config")
    clear_cache()


@dataclass(eq=False)
class ChunkGroup:
    """One launch's worth: tensors sharing a dtype combination."""

    indices: list[int]
    dtypes: tuple[torch.dtype, ...]
    config: tuple[int, int, int]  # (BLOCK, ITERS, num_warps); a program covers BLOCK * ITERS elements
    n_tensors: int
    n_chunks: int
    aligned: bool
    addrs: torch.Tensor
    numels: torch.Tensor
    first_chunk: torch.Tensor
    chunk_start: torch.Tensor
    chunk_tensor: torch.Tensor


@dataclass(eq=False)
class ChunkTable:
    device: torch.device
    groups: list[ChunkGroup]


_cache: OrderedDict[tuple, ChunkTable] = OrderedDict()
_lock = threading.Lock()


def clear_cache() -> None:
    with _lock:
        _cache.clear()


def cache_size() -> int:
    return len(_cache)


def _check(op: str, lists) -> torch.device:
    names = ("params", "grads", "exp_avgs", "exp_avg_sqs")
    check_lists(op, *lists)
    device = lists[0][0].device
    if device.type != "cuda" and not (device.type == "cpu" and interpreting()):
        raise OpArgumentError(f"{op}: the Triton kernel needs CUDA tensors, got tensors on {device} "
                         "(on CPU it runs only under TRITON_INTERPRET=1, for tests)")
    for li, lst in enumerate(lists):
        for i, t in enumerate(lst):
            if t.device != device:
                raise OpArgumentError(f"{op}: {names[li]}[{i}] is on {t.device}, {names[0]}[0] on {device}; "
                                 "one call takes tensors of one device")
            if t.dtype not in _SUPPORTED:
                raise TypeError(f"{op}: {names[li]}[{i}] has dtype {t.dtype}; the Triton kernel takes "
                                "float32, bfloat16 or float16")
            if not t.is_contiguous():
                raise OpArgumentError(f"{op}: {names[li]}[{i}] is not contiguous; pass contiguous tensors "
                                 "(e.g. .contiguous(), or keep optimizer state contiguous)")
    return device


def chunk_layout(lengths: torch.Tensor, chunk: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Programs of ``chunk`` elements over runs of ``lengths`` (int64, on the host): ``first`` [N+1] (run i owns
    programs ``first[i] : first[i+1]``), and per program its run and its start within the run."""
    n = len(lengths)
    per = (lengths + chunk - 1) // chunk
    first = torch.zeros(n + 1, dtype=torch.int64)
    torch.cumsum(per, 0, out=first[1:])
    owner = torch.repeat_interleave(torch.arange(n, dtype=torch.int64), per)
    start = (torch.arange(int(first[-1]), dtype=torch.int64) - first[owner]) * chunk
    return first, owner, start


def upload(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``host`` on ``device`` without waiting for the device. A copy from pageable memory would first wait for the
    stream's queued work; through pinned memory it is queued like a kernel, and torch's pinned-memory cache keeps
    the staging buffer until the copy has run (nobody needs to hold it)."""
    if device.type != "cuda":
        return host
    return host.pin_memory().to(device, non_blocking=True)


def _build_group(lists, indices, dtypes, device, config) -> ChunkGroup:
    n = len(indices)
    addr_rows = [[lst[i].data_ptr() for i in indices] for lst in lists]
    numels = torch.tensor([lists[0][i].numel() for i in indices], dtype=torch.int64)
    first, chunk_tensor, chunk_start = chunk_layout(numels, config[0] * config[1])
    n_chunks = len(chunk_start)
    addrs = torch.tensor(addr_rows, dtype=torch.int64).reshape(-1)
    aligned = all(a % 16 == 0 for row in addr_rows for a in row)
    dev = upload(torch.cat([addrs, numels, first, chunk_start, chunk_tensor]), device)
    parts = torch.split(dev, [len(addrs), n, n + 1, n_chunks, n_chunks])
    return ChunkGroup(indices=list(indices), dtypes=dtypes, config=config, n_tensors=n, n_chunks=n_chunks,
                      aligned=aligned, addrs=parts[0], numels=parts[1], first_chunk=parts[2], chunk_start=parts[3],
                      chunk_tensor=parts[4])


def table_for(op: str, lists) -> ChunkTable | None:
    """The (cached) chunk table of ``lists``; None when there is nothing to do (no elements)."""
    if not lists[0]:
        check_lists(op, *lists)
        return None
    key = (_forced_config(), interpreting(),
           *(tuple(map(_ptr, lst)) + tuple(map(_numel, lst)) + tuple(map(_dtype, lst)) for lst in lists))
    with _lock:
        table = _cache.get(key)
        if table is not None:
            _cache.move_to_end(key)
            return table if table.groups else None
    device = _check(op, lists)
    by_dtype: dict[tuple, list[int]] = {}
    for i in range(len(lists[0])):
        if lists[0][i].numel() == 0:
            continue
        by_dtype.setdefault(tuple(lst[i].dtype for lst in lists), []).append(i)
    groups = [_build_group(lists, idx, dts, device, launch_config(dts[0])) for dts, idx in by_dtype.items()]
    table = ChunkTable(device=device, groups=groups)
    with _lock:
        _cache[key] = table
        while len(_cache) > _CACHE_SIZE:
            _cache.popitem(last=False)
    return table if groups else None

