"""What trainers expect of an engine beyond polyaccel's engine contract, as an adapter.

Hugging Face Accelerate and Lightning drive an engine DeepSpeed-style: the trainer decides where the
gradient-accumulation boundary is (``set_gradient_accumulation_boundary``), asks for the global
gradient norm of the last step (``get_global_grad_norm``), and may end an epoch on a partial
accumulation window. The polyaccel engine counts micro-steps itself and exposes ``last_grad_norm``;
:class:`EngineAdapter` bridges the two without touching the engine.
"""

from __future__ import annotations

from ..errors import PolyaccelError


class EngineAdapter:
    """Wrap a polyaccel engine (``polyaccel.initialize``'s result) with the trainer-facing extras.

    - ``set_gradient_accumulation_boundary(is_boundary)``: the next :meth:`step` steps the optimizer
      (``True``) or only counts a micro-step (``False``), whatever the engine's own count says; used
      for a last, partial accumulation window of an epoch.
    - ``get_global_grad_norm()``: the global gradient norm of the last optimizer step (before
      clipping), or ``None`` before the first.
    - everything else (``backward``, ``forward``, ``save_checkpoint`` ...) is the engine's.
    """

    def __init__(self, engine):
        self.engine = engine
        self._boundary: bool | None = None

    def __getattr__(self, name):
        return getattr(self.engine, name)

    def __call__(self, *args, **kwargs):
        return self.engine(*args, **kwargs)

    def set_gradient_accumulation_boundary(self, is_boundary: bool) -> None:
        self._boundary = bool(is_boundary)

    def is_gradient_accumulation_boundary(self) -> bool:
        if self._boundary is not None:
            return self._boundary
        return self.engine.is_gradient_accumulation_boundary()

    def get_global_grad_norm(self) -> float | None:
        return self.engine.last_grad_norm

    def step(self, boundary: bool | None = None) -> bool:
        """The engine's ``step()`` at the boundary the trainer chose (``boundary`` or the last
        ``set_gradient_accumulation_boundary``); True when the optimizer was applied."""
        want = self._boundary if boundary is None else bool(boundary)
        self._boundary = None
        eng = self.engine
        if want is not None and want != eng.is_gradient_accumulation_boundary():
            gas = eng.gradient_accumulation_steps
            if want:  # a short window: move the count to the window's last micro-step
                eng.micro_steps += gas - 1 - eng.micro_steps % gas
            elif gas == 1:
                raise PolyaccelError("the engine's gradient_accumulation_steps is 1: every micro-step is an optimizer "
                                   "boundary, so the trainer cannot defer one; configure the engine with the "
                                   "trainer's accumulation steps")
            else:
                eng.micro_steps += 1
        return eng.step()
