"""Host buffers for offloaded optimizer state and parameters, through the accelerator contract.

Buffers come from the selected accelerator: page-locked allocations (``empty_pinned``) when
it claims ``pinned``, else ordinary host memory registered in place with the device runtime
(``register_host_memory``) when it claims ``host_register``, else plain host memory (the
cpu plugin, where host memory *is* device memory). Nothing here calls
``torch.Tensor.pin_memory`` directly.
"""

from __future__ import annotations

import torch


class HostBuffers:
    def __init__(self, accelerator, pin: bool = True):
        self.accelerator = accelerator
        self.pin = pin
        self._registered: list[torch.Tensor] = []

    @property
    def how(self) -> str:
        """How buffers are made fast to copy: "pinned", "registered" or "pageable"."""
        if not self.pin:
            return "pageable"
        if self.accelerator.has("pinned"):
            return "pinned"
        if self.accelerator.has("host_register"):
            return "registered"
        return "pageable"

    def empty(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        how = self.how
        if how == "pinned":
            return self.accelerator.empty_pinned((numel,), dtype)
        buf = torch.empty(numel, dtype=dtype)
        if how == "registered" and numel:
            self.accelerator.register_host_memory(buf)
            self._registered.append(buf)
        return buf

    def release(self) -> None:
        """Unregister what was registered (a refused unregister leaks rather than frees)."""
        while self._registered:
            self.accelerator.unregister_host_memory(self._registered.pop())


class HostTransfer:
    """Moves data between the device (compute dtype) and host master buffers (fp32) without ever changing
    the dtype inside a cross-device copy: such a copy ran about 40x slower than a plain one on an H200.
    Device data is converted on the device and copied down as it is (straight into the host buffer when
    that slice holds nothing yet since the last zero_grad); host data is converted into pinned staging
    first and then uploaded as is.

    It also keeps, per destination buffer, the squared norm of what was written there since
    :meth:`reset_norms`, computed where the data is before it is copied (so an offloaded step never
    reduces the whole fp32 gradient on the host) — exact only while every write was fresh."""

    def __init__(self, host: HostBuffers, accelerator, device: torch.device):
        self.host = host
        self.accelerator = accelerator
        self.crosses = device.type != "cpu"
        self._staging: dict[str, torch.Tensor] = {}
        self._pending: list[tuple[torch.Tensor, torch.Tensor]] = []  # (host slice, staged copy) to add
        self._in_flight = False  # copies down started since the last flush
        self._ranges: list[tuple[int, int]] = []
        self._sq: dict[int, torch.Tensor | None] = {}  # id(buffer) -> float64 squared norm; None: not exact
        self._up: torch.Tensor | None = None
        self._up_used = 0
        self._events = self.crosses and accelerator.has("events")
        self._up_done = None  # an event after the latest upload from the staging buffer

    def _buffer(self, role: str, numel: int, dtype: torch.dtype) -> torch.Tensor:
        buf = self._staging.get(role)
        if buf is None or buf.numel() < numel or buf.dtype != dtype:
            buf = self.host.empty(max(numel, 1), dtype)
            self._staging[role] = buf
        return buf[:numel]

    def _crosses(self, a: torch.Tensor, b: torch.Tensor) -> bool:
        """Whether a copy between ``a`` and ``b`` goes between host and device memory."""
        return self.crosses and a.device != b.device

    # ------------------------------------------------------------ norms
    def track(self, base: torch.Tensor, src: torch.Tensor, fresh: bool) -> None:
        """Count ``src``, written into ``base``, in ``base``'s squared norm (``fresh``: it overwrote what was
        there; otherwise the norm is no longer known). :meth:`add_later` does this unless told not to."""
        key = id(base)
        if not fresh:
            self._sq[key] = None
            return
        if key in self._sq and self._sq[key] is None:
            return
        # accumulated in fp32 at least (a 16-bit result would keep three digits), never via a float64 copy
        wide = torch.float32 if src.dtype in (torch.bfloat16, torch.float16) else None
        sq = torch.linalg.vector_norm(src, dtype=wide).double().square()
        self._sq[key] = sq if self._sq.get(key) is None else self._sq[key] + sq

    def squared_norm(self, base: torch.Tensor) -> float | None:
        """Squared norm of everything written into ``base`` since :meth:`reset_norms`, or None when unknown
        (nothing written, or a write added to earlier contents)."""
        sq = self._sq.get(id(base))
        return None if sq is None else float(sq)

    def reset_norms(self) -> None:
        self._sq.clear()

    # ------------------------------------------------------------ down
    def add_later(self, dst: torch.Tensor, src: torch.Tensor, base: torch.Tensor, fresh: bool = False,
                  track: bool = True) -> None:
        """``dst += src`` (``dst = src`` when ``fresh``), ``dst`` a slice of the host buffer ``base``.

        On one device it happens at once. Across devices ``src`` is converted to ``dst``'s dtype on its own
        device first; a fresh slice is then copied straight into ``dst`` asynchronously, otherwise into a
        staging buffer whose addition waits for :meth:`flush`. The device memory of ``src`` can be freed
        as soon as the caller drops it (stream order)."""
        src = src.reshape(-1)
        if not src.numel():
            return
        if track:
            self.track(base, src, fresh)
        if not self._crosses(dst, src):
            if fresh:
                dst.copy_(src.view_as(dst))
            else:
                dst.add_(src.view_as(dst))
            return
        src = src.to(dst.dtype)
        self._in_flight = True
        if fresh:
            dst.copy_(src.view_as(dst), non_blocking=True)
            return
        off = (dst.data_ptr() - base.data_ptr()) // base.element_size()
        n = src.numel()
        if any(o < off + n and off < o + m for o, m in self._ranges):  # the same slice twice: settle the first
            self.flush()
        stage = self._buffer(f"down-{id(base)}", base.numel(), dst.dtype)[off:off + n]
        stage.copy_(src, non_blocking=True)
        self._pending.append((dst, stage))
        self._ranges.append((off, n))

    def flush(self) -> None:
        """Finish every :meth:`add_later` (one synchronisation)."""
        if not self._in_flight:
            return
        self.accelerator.synchronize()
        for dst, stage in self._pending:
            dst.add_(stage.view_as(dst))
        self._pending.clear()
        self._in_flight = False
        self._ranges.clear()

    # ------------------------------------------------------------ up
    def start_upload(self, numel: int, dtype: torch.dtype) -> None:
        """Begin a round of :meth:`upload` calls totalling at most ``numel`` elements of ``dtype``: waits until
        the previous round has left the staging buffer, which the new round overwrites."""
        if self.crosses:
            if self._up_done is not None:
                self._up_done.synchronize()
            else:
                self.accelerator.synchronize()
            self._up = self._buffer("up", numel, dtype)
        self._up_used = 0

    def upload(self, pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """``device.copy_(host)`` for each ``(device, host)`` pair: converted on the host into this round's
        staging buffer, then uploaded asynchronously, so the caller's next host work overlaps the copy."""
        uploaded = False
        for d, h in pairs:
            n = d.numel()
            if not n:
                continue
            if not self._crosses(d, h):
                d.copy_(h.view_as(d))
                continue
            if self._up is None or self._up_used + n > self._up.numel() or self._up.dtype != d.dtype:
                raise RuntimeError("HostTransfer.upload beyond the round started by start_upload")
            piece = self._up[self._up_used:self._up_used + n]
            self._up_used += n
            piece.copy_(h.reshape(-1))
            d.copy_(piece.view_as(d), non_blocking=True)
            uploaded = True
        if uploaded and self._events:
            self._up_done = self.accelerator.Event()
            self._up_done.record()

    def copy_to_device(self, pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """:meth:`upload` of ``pairs`` as one round."""
        pairs = [(d, h) for d, h in pairs if d.numel()]
        if pairs:
            self.start_upload(sum(d.numel() for d, _ in pairs), pairs[0][0].dtype)
            self.upload(pairs)
