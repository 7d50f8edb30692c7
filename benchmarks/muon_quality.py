"""Muon against AdamW on the bundled text: `polyaccel train` with each, a small lr sweep, the loss curves.

    python benchmarks/muon_quality.py [--steps 300] [--svg docs/muon-quality.svg] [--json out.json]

Each optimizer trains the same model on the same batches (same seed) for ``--steps`` steps at each lr of its
sweep; the best lr of each (lowest final loss: the mean of the last ``WINDOW`` steps) is kept. It prints, as
Markdown, the final losses and the step at which Muon's trailing mean loss first reaches AdamW's final loss,
and draws both curves (trailing means over ``WINDOW`` steps) as an SVG written by hand (no plotting library).
Runs on the cpu plugin in a few minutes; ``--nproc``/``--stage`` pass through to `polyaccel train`.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

WINDOW = 10
MODEL = ["--model", "llama", "--hidden-size", "128", "--layers", "2", "--heads", "4", "--batch-size", "8",
         "--seq-len", "64", "--threads", "1", "--grad-clip", "1.0"]
SWEEP = {"adamw": [3e-4, 1e-3, 3e-3], "muon": [0.005, 0.01, 0.02]}


def train(optimizer: str, lr: float, steps: int, nproc: int, stage: int, out: Path) -> list[float]:
    cmd = [sys.executable, "-c", "import sys; from polyaccel.cli import main; sys.exit(main())", "train",
           *MODEL, "--optimizer", optimizer, "--lr", str(lr),
           "--steps", str(steps), "--nproc", str(nproc), "--stage", str(stage), "--metrics-out", str(out)]
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"polyaccel train failed ({' '.join(cmd)}):\n{done.stderr[-2000:]}")
    return json.loads(out.read_text())["losses"]


def trailing_mean(xs: list[float], w: int = WINDOW) -> list[float]:
    return [sum(xs[max(0, i - w + 1):i + 1]) / (i + 1 - max(0, i - w + 1)) for i in range(len(xs))]


def steps_to_reach(curve: list[float], target: float) -> int | None:
    """The first step (1-based) whose trailing mean is at most ``target``, or None."""
    for i, v in enumerate(curve):
        if i + 1 >= WINDOW and v <= target:
            return i + 1
    return None


def svg(curves: dict[str, list[float]], labels: dict[str, str], target: float) -> str:
    """A line plot of the curves (x: step, y: loss), with AdamW's final loss as a dashed line."""
    w, h, left, right, top, bottom = 640, 400, 60, 20, 30, 50
    n = max(len(c) for c in curves.values())
    lo = min(min(c) for c in curves.values())
    hi = max(max(c[WINDOW - 1:]) for c in curves.values())
    lo, hi = lo - 0.05 * (hi - lo), hi + 0.05 * (hi - lo)

    def x(i):
        return left + (w - left - right) * i / max(1, n - 1)

    def y(v):
        return top + (h - top - bottom) * (hi - v) / (hi - lo)

    colours = {"adamw": "#1f77b4", "muon": "#d62728"}
    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{w}" height="{h}" font-family="sans-serif" '
             'font-size="12">', f'<rect width="{w}" height="{h}" fill="white"/>',
             f'<line x1="{left}" y1="{h - bottom}" x2="{w - right}" y2="{h - bottom}" stroke="black"/>',
             f'<line x1="{left}" y1="{top}" x2="{left}" y2="{h - bottom}" stroke="black"/>']
    for k in range(6):
        v = lo + (hi - lo) * k / 5
        parts.append(f'<text x="{left - 6}" y="{y(v) + 4:.1f}" text-anchor="end">{v:.2f}</text>')
        parts.append(f'<line x1="{left}" y1="{y(v):.1f}" x2="{w - right}" y2="{y(v):.1f}" stroke="#eee"/>')
    for k in range(6):
        i = round((n - 1) * k / 5)
        parts.append(f'<text x="{x(i):.1f}" y="{h - bottom + 16}" text-anchor="middle">{i + 1}</text>')
    parts.append(f'<text x="{(left + w - right) / 2}" y="{h - 12}" text-anchor="middle">optimizer step</text>')
    parts.append(f'<text x="14" y="{(top + h - bottom) / 2}" text-anchor="middle" '
                 f'transform="rotate(-90 14 {(top + h - bottom) / 2})">loss (mean of the last {WINDOW} steps)</text>')
    parts.append(f'<line x1="{left}" y1="{y(target):.1f}" x2="{w - right}" y2="{y(target):.1f}" '
                 'stroke="#777" stroke-dasharray="4 3"/>')
    for j, (name, c) in enumerate(curves.items()):
        pts = " ".join(f"{x(i):.1f},{y(v):.1f}" for i, v in enumerate(c) if i + 1 >= WINDOW)
        parts.append(f'<polyline fill="none" stroke="{colours[name]}" stroke-width="1.5" points="{pts}"/>')
        parts.append(f'<text x="{w - right - 8}" y="{top + 16 * j}" text-anchor="end" fill="{colours[name]}">'
                     f'{labels[name]}</text>')
    parts.append("</svg>")
    return "\n".join(parts) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--nproc", type=int, default=1)
    ap.add_argument("--stage", type=int, default=1)
    ap.add_argument("--svg", default="docs/muon-quality.svg")
    ap.add_argument("--json", default=None, help="also write every run's losses here")
    args = ap.parse_args(argv)
    runs: dict[str, dict[float, list[float]]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for opt, lrs in SWEEP.items():
            runs[opt] = {lr: train(opt, lr, args.steps, args.nproc, args.stage, Path(tmp) / f"{opt}-{lr}.json")
                         for lr in lrs}
    final = {opt: {lr: sum(ls[-WINDOW:]) / WINDOW for lr, ls in by_lr.items()} for opt, by_lr in runs.items()}
    best = {opt: min(f, key=f.get) for opt, f in final.items()}
    curves = {opt: trailing_mean(runs[opt][best[opt]]) for opt in runs}
    target = final["adamw"][best["adamw"]]
    reach = steps_to_reach(curves["muon"], target)
    print(f"| optimizer | lr | final loss (mean of last {WINDOW} of {args.steps} steps) |")
    print("|---|---|---|")
    for opt, f in final.items():
        for lr, v in f.items():
            print(f"| {opt} | {lr:g}{' (best)' if lr == best[opt] else ''} | {v:.4f} |")
    print(f"\nMuon (lr {best['muon']:g}) reaches AdamW's final loss {target:.4f} (lr {best['adamw']:g}, "
          f"{args.steps} steps) at step {reach if reach is not None else 'never'}"
          + (f": {reach / args.steps:.0%} of AdamW's steps" if reach else ""))
    labels = {"adamw": f"AdamW lr {best['adamw']:g}", "muon": f"Muon lr {best['muon']:g}"}
    Path(args.svg).write_text(svg(curves, labels, target))
    print(f"wrote {args.svg}")
    if args.json:
        Path(args.json).write_text(json.dumps({o: {str(lr): ls for lr, ls in r.items()} for o, r in runs.items()}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
