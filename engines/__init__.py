"""Training engines built only on polyaccel's contracts (found through ``polyaccel.engines``)."""
