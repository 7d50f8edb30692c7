"""Rank 0's view of a run: a rich progress bar with loss and tokens/s, or plain lines in logs.

On a terminal the bar redraws in place; when output goes to a file or a pipe (CI, tests) the
bar is not drawn and a line is printed every ``log_every`` steps instead, so logs still show
progress.
"""

from __future__ import annotations

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn


class TrainProgress:
    def __init__(self, total_steps: int, start_step: int, log_every: int, enabled: bool,
                 console: Console | None = None):
        self.enabled = enabled
        self.total = total_steps
        self.log_every = max(1, log_every)
        self.console = console or Console()
        self._progress: Progress | None = None
        self._task = None
        self._start = start_step
        if enabled and self.console.is_terminal:
            self._progress = Progress(
                TextColumn("[bold]train"), BarColumn(), MofNCompleteColumn(),
                TextColumn("loss [cyan]{task.fields[loss]}"), TextColumn("[green]{task.fields[tps]} tok/s"),
                TimeElapsedColumn(), TextColumn("eta"), TimeRemainingColumn(),
                console=self.console,
            )
            self._task = self._progress.add_task("train", total=total_steps, completed=start_step,
                                                 loss="-", tps="-")

    def __enter__(self) -> TrainProgress:
        if self._progress is not None:
            self._progress.start()
        return self

    def __exit__(self, *exc) -> None:
        if self._progress is not None:
            self._progress.stop()

    def update(self, step: int, loss: float, tokens_per_s: float) -> None:
        """``step`` is the number of optimizer steps done (1-based)."""
        if not self.enabled:
            return
        if self._progress is not None:
            self._progress.update(self._task, completed=step, loss=f"{loss:.4f}", tps=f"{tokens_per_s:,.0f}")
        elif step % self.log_every == 0 or step == self.total or step == self._start + 1:
            self.console.print(f"step {step}/{self.total}  loss {loss:.4f}  {tokens_per_s:,.0f} tok/s",
                               highlight=False)

    def note(self, message: str) -> None:
        if self.enabled:
            self.console.print(message, highlight=False)
