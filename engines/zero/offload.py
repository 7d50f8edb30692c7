"""Host buffers for offloaded optimizer state and parameters, through the accelerator contract.

Buffers come from the selected accelerator: page-locked allocations (``empty_pinned``) when
it claims ``pinned``, else ordinary host memory registered in place with the device runtime
(``register_host_memory``) when it claims ``host_register``, else plain host memory (the
cpu plugin, where host memory *is* device memory). Buffers of ``REGISTER_FROM_BYTES`` or more
are registered in place wherever the accelerator claims ``host_register``, even if it can pin:
a pinned allocation may be rounded up by the runtime's allocator (torch's caching host allocator
rounds every block to a power of two: a 19 GB fp32 master of a 4.8B-parameter model takes 32 GiB,
and four such buffers outgrow a 128 GiB host) and is made as a pinned copy of a pageable buffer
(twice the memory while it copies). Nothing here calls ``torch.Tensor.pin_memory`` directly.
"""

from __future__ import annotations

import contextlib
import threading

import torch

#: buffers of at least this many bytes are registered in place rather than pinned (see the module docstring);
#: below it a registration's fixed cost (a runtime call per buffer, kept until :meth:`HostBuffers.release`)
#: outweighs what rounding can waste
REGISTER_FROM_BYTES = 64 << 20


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
        if how == "pinned" and numel * dtype.itemsize >= REGISTER_FROM_BYTES and self.accelerator.has("host_register"):
            how = "registered"
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


#: largest piece of an upload staged through one device buffer (elements): bounds the transient device memory
UPLOAD_PIECE = 1 << 23


class HostTransfer:
    """Moves data between the device (compute dtype) and host master buffers (fp32) without ever changing
    the dtype inside a cross-device copy: such a copy ran about 40x slower than a plain one on an H200.
    Device data is converted on the device and copied down as it is (straight into the host buffer when
    that slice holds nothing yet since the last zero_grad). Host data is uploaded as it is, in pieces of at
    most ``UPLOAD_PIECE`` elements through a device buffer of the host dtype, and converted on the device
    (fp32 -> bf16 on the host cost a third of the host's time in an offloaded step: 19 of 72 ms at 220M).

    Where the device has streams and events, both directions run on a copy stream of their own: a copy in
    the compute stream stalls every kernel queued after it (the copies down and up, ~24 ms at 220M, sat in
    backward). A copy waits for the compute stream's work queued before it was issued; what it reads on the
    device is kept referenced until its event has passed. Uploads are joined to the caller's stream at
    once unless ``defer_settle`` is set, then by :meth:`settle` (the overlapped step joins them at its end,
    so backward's kernels never wait for them).

    It also keeps, per destination buffer, the squared norm of what was written there since
    :meth:`reset_norms`, computed where the data is before it is copied (so an offloaded step never
    reduces the whole gradient on the host) — exact only while every write was fresh."""

    def __init__(self, host: HostBuffers, accelerator, device: torch.device):
        self.host = host
        self.accelerator = accelerator
        self.crosses = device.type != "cpu"
        self._staging: dict[str, torch.Tensor] = {}
        self._pending: list[tuple[torch.Tensor, torch.Tensor]] = []  # (host slice, staged copy) to add
        self._in_flight = False  # copies down started since the last flush
        self._ranges: list[tuple[int, int]] = []
        self._sq: dict[int, torch.Tensor | None] = {}  # id(buffer) -> float64 squared norm; None: not exact
        self._up_numel = 0
        self._up_used = 0
        self._up_done = None  # an event after the latest upload (it read the host master)
        self._up_unevented = False  # an upload crossed since the last start_upload, on a device without events
        # the device's index, resolved here on the engine's thread: the overlapped step's worker thread has
        # its own current device (0), so its streams and waits name the device explicitly
        self._index = device.index if device.index is not None or device.type == "cpu" else \
            accelerator.current_device()
        self._streams: dict | None = None  # made at the first copy across (see _copy_streams)
        self._streams_made = False
        self._held: list[tuple[object, torch.Tensor]] = []  # (event, device tensor a copy stream op still reads)
        self._lock = threading.Lock()  # the overlapped step's worker uploads while backward copies down
        self.defer_settle = False

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

    def squared_norm(self, base: torch.Tensor) -> torch.Tensor | None:
        """Squared norm (a float64 scalar tensor where the data was) of everything written into ``base`` since
        :meth:`reset_norms`, or None when unknown (nothing written, or a write added to earlier contents)."""
        return self._sq.get(id(base))

    def reset_norms(self) -> None:
        self._sq.clear()

    # ------------------------------------------------------------ down
    def add_later(self, dst: torch.Tensor, src: torch.Tensor, base: torch.Tensor, fresh: bool = False,
                  track: bool = True) -> None:
        """``dst += src`` (``dst = src`` when ``fresh``), ``dst`` a slice of the host buffer ``base``.

        On one device it happens at once. Across devices ``src`` is converted to ``dst``'s dtype on its own
        device first; a fresh slice is then copied straight into ``dst`` asynchronously, otherwise into a
        staging buffer whose addition waits for :meth:`flush`. The caller may drop ``src`` at once: the
        transfer keeps what the copy reads referenced until the copy has passed it."""
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
            with self._on_copy_stream("down", src):
                dst.copy_(src.view_as(dst), non_blocking=True)
            return
        off = (dst.data_ptr() - base.data_ptr()) // base.element_size()
        n = src.numel()
        if any(o < off + n and off < o + m for o, m in self._ranges):  # the same slice twice: settle the first
            self.flush()
        stage = self._buffer(f"down-{id(base)}", base.numel(), dst.dtype)[off:off + n]
        with self._on_copy_stream("down", src):
            stage.copy_(src, non_blocking=True)
        self._pending.append((dst, stage))
        self._ranges.append((off, n))

    # ------------------------------------------------------------ copy stream
    @contextlib.contextmanager
    def _on_copy_stream(self, way: str, *device_tensors: torch.Tensor):
        """Run the body's copies on the ``way`` ("down", "up") copy stream when there is one, after the
        caller's stream's work so far; ``device_tensors`` stay referenced until the copies have passed them."""
        streams = self._copy_streams()
        if streams is None:
            yield
            return
        acc = self.accelerator
        if way not in streams:  # the parameters' stream (offload_param), made at its first gather
            streams[way] = acc.Stream(self._index)
        stream = streams[way]
        with self._lock:
            self._held = [(e, t) for e, t in self._held if not e.query()]
        stream.wait_stream(acc.current_stream(self._index))
        if way == "down" and "params" in streams:  # a host step after this copy may overwrite what they read
            stream.wait_stream(streams["params"])
        with acc.stream(stream):
            yield
        event = acc.Event()
        event.record(stream)
        with self._lock:
            self._held.extend((event, t) for t in device_tensors)

    def _copy_streams(self) -> dict | None:
        """One stream each way (a copy down and an upload run at once on the device's two copy engines), where
        copies cross to a device with streams and events; else None. ``params`` (see :meth:`upload_shards`) is
        added at its first use."""
        if not self._streams_made:
            self._streams_made = True
            acc = self.accelerator
            if self.crosses and acc.has("events") and acc.has("streams"):
                self._streams = {"down": acc.Stream(self._index), "up": acc.Stream(self._index)}
        return self._streams

    def copy_event(self, way: str = "down"):
        """An event after every copy issued so far that way (recorded where those copies run), or None
        without events."""
        if not (self.crosses and self.accelerator.has("events")):
            return None
        event = self.accelerator.Event()
        streams = self._copy_streams()
        if streams is None:
            event.record()
        else:
            event.record(streams[way])
        return event

    def upload_shards(self, shards: list[torch.Tensor], device: torch.device) -> tuple[torch.Tensor, object | None]:
        """Host parameter shards (``offload_param``) in one new device tensor, for a stage-3 gather; returns it
        and an event the reader's stream must wait for (:meth:`join`) before reading it (None: ready as returned).

        The copies run on a stream of their own (``params``), after the caller's stream's work so far: queued
        in the compute stream they ran between its kernels, in line with them (2 bytes a parameter in forward
        and again in backward: 76 ms of a 1B model's step on an H100). Copies down wait for them, so the
        host step that follows a gradient's copy down never overwrites a shard an upload still reads."""
        flat = [s.reshape(-1) for s in shards]
        # allocated in the caller's stream, which frees it only after it waited for the event (so it is not held
        # here: a released parameter's memory is free at once); the copy stream waits for that stream's work first
        out = torch.empty(sum(f.numel() for f in flat), dtype=flat[0].dtype, device=device)
        if not self._crosses(out, flat[0]):
            return flat[0] if len(flat) == 1 else torch.cat(flat, out=out), None
        with self._on_copy_stream("params"):
            col = 0
            for f in flat:
                out[col:col + f.numel()].copy_(f, non_blocking=True)
                col += f.numel()
        return out, (self.copy_event("params") if self._streams is not None else None)

    def join(self, event) -> None:
        """Make the caller's stream wait for ``event`` (one of :meth:`upload_shards`)."""
        self.accelerator.current_stream(self._index).wait_event(event)

    def settle(self) -> None:
        """Make the caller's stream wait for every copy issued so far (the uploads' results are read there)."""
        if self._streams is not None:  # none made: no copy was issued on one
            current = self.accelerator.current_stream(self._index)
            for stream in self._streams.values():
                current.wait_stream(stream)

    def flush(self) -> None:
        """Finish every :meth:`add_later` (one synchronisation)."""
        if not self._in_flight:
            return
        self.accelerator.synchronize()
        with self._lock:
            self._held.clear()
        for dst, stage in self._pending:
            dst.add_(stage.view_as(dst))
        self._pending.clear()
        self._in_flight = False
        self._ranges.clear()

    # ------------------------------------------------------------ up
    def start_upload(self, numel: int, dtype: torch.dtype) -> None:
        """Begin a round of :meth:`upload` calls totalling at most ``numel`` elements: waits until the previous
        round's copies across have read their host sources (the master, which the coming step overwrites). A
        round that copied nothing across waits for nothing: copies within the device are ordered by its stream
        (a wait there would stop the host queueing the next step at every step)."""
        if self._up_done is not None:
            self._up_done.synchronize()
        elif self._up_unevented:
            self.accelerator.synchronize()
        self._up_unevented = False
        self._up_numel = numel
        self._up_used = 0

    def upload(self, pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """``device.copy_(host)`` for each ``(device, host)`` pair: the host data is copied up as it is, then
        converted on the device; asynchronous, so the caller's next host work overlaps the copy. The host
        sources must stay unchanged until the next :meth:`start_upload` (which waits for these copies)."""
        uploaded = False
        for d, h in pairs:
            n = d.numel()
            if not n:
                continue
            if not self._crosses(d, h):
                d.copy_(h.view_as(d))
                continue
            if self._up_used + n > self._up_numel:
                raise RuntimeError("HostTransfer.upload beyond the round started by start_upload")
            self._up_used += n
            self._upload_one(d, h.reshape(-1))
            uploaded = True
        if not uploaded:
            return
        if (event := self.copy_event("up")) is not None:
            self._up_done = event
            if not self.defer_settle:
                self.settle()
        else:
            self._up_unevented = True

    def _upload_one(self, d: torch.Tensor, h: torch.Tensor) -> None:
        """``d.copy_(h)`` across, ``h`` flat: as it is when the dtypes agree, else through a device buffer of
        ``h``'s dtype (pieces of ``UPLOAD_PIECE`` where ``d`` is contiguous) converted on the device."""
        if d.dtype == h.dtype:
            with self._on_copy_stream("up", d):
                d.copy_(h.view_as(d), non_blocking=True)
            return
        flat = d.view(-1) if d.is_contiguous() else None
        step = min(UPLOAD_PIECE, h.numel()) if flat is not None else h.numel()
        with self._on_copy_stream("up", d):
            # allocated on the copy stream: the allocator reuses it only after the stream has passed its use
            piece = torch.empty(step, dtype=h.dtype, device=d.device)
            if flat is None:
                piece.copy_(h, non_blocking=True)
                d.copy_(piece.view_as(d))
            else:
                for lo in range(0, h.numel(), step):
                    hi = min(lo + step, h.numel())
                    piece[:hi - lo].copy_(h[lo:hi], non_blocking=True)
                    flat[lo:hi].copy_(piece[:hi - lo])
            del piece

    def copy_to_device(self, pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """:meth:`upload` of ``pairs`` as one round."""
        pairs = [(d, h) for d, h in pairs if d.numel()]
        if pairs:
            self.start_upload(sum(d.numel() for d, _ in pairs), pairs[0][0].dtype)
            self.upload(pairs)
