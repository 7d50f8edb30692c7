"""fp16 loss scaling: a static scale, or a dynamic one that halves on overflow and grows when stable.

Dynamic rules (DeepSpeed's): an overflow skips the step; after ``hysteresis`` overflows the
scale is halved (never below ``min_loss_scale``); after ``loss_scale_window`` steps without
an overflow it doubles and the hysteresis budget is restored.
"""

from __future__ import annotations

from .config import Fp16Config


class LossScaler:
    def __init__(self, cfg: Fp16Config | None):
        self.enabled = bool(cfg and cfg.enabled)
        self.dynamic = self.enabled and cfg.dynamic
        if not self.enabled:
            self.scale = 1.0
            return
        self.scale = float(2 ** cfg.initial_scale_power) if cfg.dynamic else float(cfg.loss_scale)
        self.window = cfg.loss_scale_window
        self.hysteresis = cfg.hysteresis
        self.min_scale = cfg.min_loss_scale
        self.cur_hysteresis = cfg.hysteresis
        self.iteration = 0
        self.last_overflow = -1

    def update(self, overflow: bool) -> None:
        if not self.dynamic:
            return
        if overflow:
            if self.hysteresis == 1 or self.cur_hysteresis == 1:
                self.scale = max(self.scale / 2.0, self.min_scale)
            else:
                self.cur_hysteresis -= 1
            self.last_overflow = self.iteration
        elif (self.iteration - self.last_overflow) % self.window == 0:
            self.cur_hysteresis = self.hysteresis
            self.scale *= 2.0
        self.iteration += 1

    def state_dict(self) -> dict:
        if not self.enabled:
            return {"scale": 1.0}
        return {"scale": self.scale, "cur_hysteresis": self.cur_hysteresis, "iteration": self.iteration,
                "last_overflow": self.last_overflow}

    def load_state_dict(self, state: dict) -> None:
        if not self.enabled:
            return
        self.scale = float(state["scale"])
        for key in ("cur_hysteresis", "iteration", "last_overflow"):
            if key in state:
                setattr(self, key, int(state[key]))
