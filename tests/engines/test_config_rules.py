"""Every layer's config (and `polyaccel train`'s flags) follows polyaccel.config_check's integer rule: 2.0 is
2; 2.5, true and NaN are refused naming the key (or flag); the caller's dict is left as it was."""

from __future__ import annotations

import copy

import pytest
from polyaccel.errors import ConfigError


def _zero(value):
    from polyaccel.engines.zero.config import parse_config

    return parse_config({"zero_optimization": {"reduce_bucket_size": value}}).reduce_bucket_size


def _muon(value):
    from polyaccel.engines.zero.config import parse_config

    config = {"optimizer": {"type": "muon", "params": {"ns_steps": value}}}
    return parse_config(config).optimizer.muon.ns_steps


def _activation_checkpointing(value):
    from polyaccel.engines.zero.config import parse_config

    config = {"activation_checkpointing": {"number_checkpoints": value}}
    return parse_config(config).activation_checkpointing.number_checkpoints


def _autotp(value):
    from polyaccel.engines.autotp import parse

    return parse({"autotp_size": value}).autotp_size


def _autoep(value):
    from polyaccel.engines.autoep import parse_config

    return parse_config({"autoep_size": value}).autoep_size


def _autosp(value):
    from polyaccel.engines.autosp import parse

    return parse({"autosp_size": value}).autosp_size


def _train(value):
    from polyaccel.apps.train.model import ModelSpec

    return ModelSpec(num_layers=value).validate().num_layers


LAYERS = {  # layer -> (parse an integer field, read it back; how its errors start)
    "zero": (_zero, "config key 'zero_optimization.reduce_bucket_size' must be an integer"),
    "muon": (_muon, "config key 'optimizer.params.ns_steps' must be an integer"),
    "activation_checkpointing": (_activation_checkpointing,
                                 "config key 'activation_checkpointing.number_checkpoints' must be an "
                                 "integer"),
    "autotp": (_autotp, "config key 'tensor_parallel.autotp_size' must be an integer"),
    "autoep": (_autoep, "config key 'expert_parallel.autoep_size' must be an integer"),
    "autosp": (_autosp, "config key 'sequence_parallel.autosp_size' must be an integer"),
    "train": (_train, "--layers {}: must be an integer"),
}


@pytest.mark.parametrize("layer", sorted(LAYERS))
def test_one_integer_rule_in_every_layer(layer):
    read, start = LAYERS[layer]
    for value in (2, 2.0):
        got = read(value)
        assert got == 2 and type(got) is int, (value, got)
    for value, shown in ((2.5, "2.5"), (True, "true"), (float("nan"), "nan"), ("2", "'2'")):
        with pytest.raises(ConfigError) as info:
            read(value)
        msg = str(info.value)
        if layer == "train":  # a flag names its value first
            assert msg.startswith(start.format(repr(value) if isinstance(value, str) else value)), msg
        else:
            assert msg.startswith(start) and msg.endswith(f"got {shown}"), msg


def test_no_layer_changes_the_dict_it_is_given():
    from polyaccel.engines.autoep import parse_config as ep
    from polyaccel.engines.autosp import parse as sp
    from polyaccel.engines.autotp import parse as tp
    from polyaccel.engines.kernels import parse as kernels
    from polyaccel.engines.zero.config import parse_config as zero

    sections = [
        (zero, {"zero_optimization": {"stage": 3.0, "stage3_leaf_modules": ["Block"]},
                "optimizer": {"type": "Muon",
                              "params": {"muon_params": ["*.w"], "adam_betas": [0.9, 0.95]}}}),
        (tp, {"autotp_size": 2.0,
              "partition_config": {"layer_specs": [{"patterns": [".*q$"], "shape": [[2, 2], -1]}]}}),
        (ep, {"autoep_size": 2.0, "preset_model": "MIXTRAL", "score_func": None}),
        (sp, {"autosp_size": 2.0}),
        (kernels, {"rope": "AUTO", "swiglu": True}),
    ]
    for parse, section in sections:
        before = copy.deepcopy(section)
        parse(section)
        assert section == before and repr(section) == repr(before), parse
