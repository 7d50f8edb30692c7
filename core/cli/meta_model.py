"""Models on the meta device for the plan commands: shapes only, no weights read, nothing downloaded."""

from __future__ import annotations

import os


def meta_model(name: str, families, build, full_config, tiny_config, tiny: bool = False):
    """``name`` is a directory holding a config.json (or the file itself), or one of ``families``, built
    with ``build(config, name)`` from ``full_config(name)`` (``tiny_config`` with ``tiny``)."""
    import torch

    if os.path.isdir(name) or name.endswith(".json"):
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        from transformers import AutoConfig, AutoModelForCausalLM

        path = (os.path.dirname(name) or ".") if name.endswith(".json") else name
        cfg = AutoConfig.from_pretrained(path, local_files_only=True)
        with torch.device("meta"):
            return AutoModelForCausalLM.from_config(cfg)
    if name not in families:
        from polyaccel.errors import ConfigError

        raise ConfigError(f"--model {name!r}: choose one of {', '.join(families)} or a directory with a config.json")
    cfg = tiny_config(name) if tiny else full_config(name)
    with torch.device("meta"):
        return build(cfg, name)
