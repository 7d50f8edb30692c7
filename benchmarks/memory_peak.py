"""What is live at a CUDA memory peak, from a ``torch.cuda.memory._dump_snapshot`` pickle.

    python benchmarks/memory_peak.py SNAPSHOT.pickle [--top 15]

The snapshot's trace (record it with ``torch.cuda.memory._record_memory_history`` from before
the engine exists, so every block it allocates is in the trace) is replayed: an ``alloc`` adds
its size, a ``free_completed`` (the block back in the allocator, which is when
``memory_allocated`` drops) takes it away. At the highest point the live blocks are grouped by
where they were allocated (the innermost frame in polyaccel, transformers or the benchmark,
else the innermost frame) and the largest groups printed. ``benchmarks/zero_memory.py
--snapshot DIR`` writes one snapshot per engine.
"""

from __future__ import annotations

import argparse
import pickle
from collections import defaultdict

#: frames from these files name an allocation site; torch's own frames are skipped when one is present
OWN_CODE = ("polyaccel", "transformers", "benchmarks", "engines", "plugins")


def site(frames: list[dict]) -> str:
    """A short name for where an allocation was made: the innermost frame in our code, else the innermost."""
    own = [f for f in frames if any(p in f.get("filename", "") for p in OWN_CODE) and "/torch/" not in f["filename"]]
    f = (own or frames or [None])[0]
    if f is None:
        return "(no frames recorded)"
    return f"{f.get('filename', '?').rsplit('/', 1)[-1]}:{f.get('line')} {f.get('name')}"


def replay(events: list[dict]) -> tuple[int, dict[int, dict]]:
    """(peak traced bytes, the blocks live at that peak by address) over one device's trace."""
    frees = {"free_completed"} if any(e["action"] == "free_completed" for e in events) else {"free_requested"}
    live: dict[int, dict] = {}
    current = peak = 0
    at_peak: dict[int, dict] = {}
    for e in events:
        if e["action"] == "alloc":
            live[e["addr"]] = e
            current += e["size"]
            if current > peak:
                peak, at_peak = current, dict(live)
        elif e["action"] in frees and e["addr"] in live:  # a free of a block allocated before the trace: ignored
            current -= live.pop(e["addr"])["size"]
    return peak, at_peak


def peak_report(snapshot: dict, top: int = 15, device: int = 0) -> str:
    traces = snapshot.get("device_traces") or []
    if device >= len(traces) or not traces[device]:
        return f"no trace for device {device} (was _record_memory_history on while the step ran?)"
    peak, live = replay(traces[device])
    groups: dict[str, list[int]] = defaultdict(lambda: [0, 0])
    for block in live.values():
        g = groups[site(block.get("frames", []))]
        g[0] += block["size"]
        g[1] += 1
    rows = sorted(groups.items(), key=lambda kv: -kv[1][0])
    lines = [f"peak of the traced allocations: {peak / 2**30:.3f} GiB in {len(live)} blocks; largest sites:"]
    lines += [f"  {size / 2**30:7.3f} GiB  {count:5d} blocks  {where}" for where, (size, count) in rows[:top]]
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("snapshot")
    ap.add_argument("--top", type=int, default=15)
    ap.add_argument("--device", type=int, default=0)
    args = ap.parse_args()
    with open(args.snapshot, "rb") as f:
        print(peak_report(pickle.load(f), args.top, args.device))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
