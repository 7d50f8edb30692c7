"""The offloaded Muon step's round buffers between the host and the device, off the compute stream.

After backward, every round's buffer (pinned host memory, prepared during backward) goes to the
device, is orthogonalized there and comes back into the same host buffer. Where the device has
streams and events, all rounds go up at once on one copy stream into one device buffer (allocated
in the compute stream, which the copy stream waits for first: that memory may have been another
tensor's), each round's Newton-Schulz waits only for its own copy, and each round comes back on a
second copy stream after its Newton-Schulz; so the copies up, the iteration and the copies down
overlap instead of queueing one after another in the compute stream. The host waits for a round's
event before reading it. With events only, the copies run in the compute stream, asynchronously;
without events, they block. On one device (the cpu plugin) nothing is copied.
"""

from __future__ import annotations

import torch


class RoundTransfer:
    def __init__(self, accelerator, device: torch.device):
        self.accelerator = accelerator
        self.device = torch.device(device)
        self._streams: tuple | None = None
        self._index = None

    def _crosses(self, buf: torch.Tensor) -> bool:
        return buf.device != self.device

    @property
    def _events(self) -> bool:
        return self.accelerator is not None and self.accelerator.has("events")

    @property
    def _use_streams(self) -> bool:
        return self._events and self.accelerator.has("streams")

    def up(self, bufs: list[torch.Tensor]) -> list[tuple[torch.Tensor, object]]:
        """Each host buffer on the device, with an event the compute stream must wait for before reading it
        (:meth:`join`; None: ready in stream order)."""
        if not bufs or not self._crosses(bufs[0]):
            return [(b, None) for b in bufs]
        if not self._use_streams:
            out = [torch.empty(b.shape, dtype=b.dtype, device=self.device) for b in bufs]
            return [(d.copy_(b, non_blocking=self._events), None) for d, b in zip(out, bufs, strict=True)]
        acc = self.accelerator
        up, _ = self._copy_streams()
        flat = torch.empty(sum(b.numel() for b in bufs), dtype=bufs[0].dtype, device=self.device)
        up.wait_stream(acc.current_stream(self._index))
        out, at = [], 0
        with acc.stream(up):
            for b in bufs:
                d = flat[at:at + b.numel()]
                at += b.numel()
                d.copy_(b, non_blocking=True)
                event = acc.Event()
                event.record(up)
                out.append((d, event))
        return out

    def join(self, event) -> None:
        """Make the compute stream wait for an event of :meth:`up`."""
        if event is not None:
            self.accelerator.current_stream(self._index).wait_event(event)

    def down(self, buf: torch.Tensor, full: torch.Tensor):
        """Copy the device's round ``full`` back into its host buffer ``buf``; returns an event the host must
        synchronize before reading ``buf`` (None: already there)."""
        if full is buf:
            return None
        if not self._events:
            buf.copy_(full)
            return None
        acc = self.accelerator
        event = acc.Event()
        if not self._use_streams:
            buf.copy_(full, non_blocking=True)
            event.record()
            return event
        _, down = self._copy_streams()
        down.wait_stream(acc.current_stream(self._index))
        with acc.stream(down):
            buf.copy_(full, non_blocking=True)
        event.record(down)
        return event

    def _copy_streams(self) -> tuple:
        if self._streams is None:
            acc = self.accelerator
            self._index = self.device.index if self.device.index is not None else acc.current_device()
            self._streams = (acc.Stream(self._index), acc.Stream(self._index))
        return self._streams
