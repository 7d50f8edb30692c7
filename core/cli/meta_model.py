"""Models on the meta device for the plan commands: shapes only, no weights read, nothing downloaded."""

from __future__ import annotations

import os

from polyaccel.errors import ConfigError


class ModelArgumentError(ConfigError):
    """``--model`` names nothing a model can be built from (an unknown family, a config.json transformers
    rejects): a usage error, exit status 2."""


def meta_model(name: str, families, build, full_config, tiny_config, tiny: bool = False):
    """``name`` is a directory holding a config.json (or the file itself), or one of ``families``, built
    with ``build(config, name)`` from ``full_config(name)`` (``tiny_config`` with ``tiny``).

    A config.json that transformers cannot read or build a model from raises :class:`ModelArgumentError`
    naming the file and transformers' reason (one line), never transformers' own exception."""
    import torch

    if os.path.isdir(name) or name.endswith(".json"):
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        from transformers import AutoConfig, AutoModelForCausalLM

        path = (os.path.dirname(name) or ".") if name.endswith(".json") else name
        file = os.path.join(path, "config.json")
        if not os.path.isfile(file):
            raise ModelArgumentError(f"--model {name!r}: {file} does not exist; pass a directory holding a "
                                     "transformers config.json, or a family name")
        try:
            cfg = AutoConfig.from_pretrained(path, local_files_only=True)
            with torch.device("meta"):
                return AutoModelForCausalLM.from_config(cfg)
        except Exception as exc:  # noqa: BLE001 - transformers raises ValueError, KeyError, TypeError, ...
            raise ModelArgumentError(f"--model {name!r}: transformers cannot build a causal LM from {file} "
                                     f"({_one_line(exc)}); fix the file, or pass a family name") from None
    if name not in families:
        raise ModelArgumentError(f"--model {name!r}: choose one of {', '.join(families)} or a directory with "
                                 "a config.json")
    cfg = tiny_config(name) if tiny else full_config(name)
    with torch.device("meta"):
        return build(cfg, name)


def _one_line(exc: Exception) -> str:
    """``exc`` as ``Type: first line`` (at most 300 characters): transformers' messages run over many
    lines."""
    text = " ".join(line.strip() for line in str(exc).strip().splitlines()[:3] if line.strip())
    return f"{type(exc).__name__}: {text[:300]}"
