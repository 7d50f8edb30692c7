"""Every layer's config follows polyaccel.config_check's integer rule: 2.0 is 2; 2.5, true and NaN are refused
with the full key path; the caller's dict is left as it was."""

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


LAYERS = {  # layer -> (parse an integer field, read it back; the key path its errors name)
    "zero": (_zero, "zero_optimization.reduce_bucket_size"),
    "muon": (_muon, "optimizer.params.ns_steps"),
    "activation_checkpointing": (_activation_checkpointing, "activation_checkpointing.number_checkpoints"),
    "autotp": (_autotp, "tensor_parallel.autotp_size"),
    "autoep": (_autoep, "expert_parallel.autoep_size"),
    "autosp": (_autosp, "sequence_parallel.autosp_size"),
}


@pytest.mark.parametrize("layer", sorted(LAYERS))
def test_one_integer_rule_in_every_layer(layer):
    read, path = LAYERS[layer]
    for value in (2, 2.0):
        got = read(value)
        assert got == 2 and type(got) is int, (value, got)
    for value, shown in ((2.5, "2.5"), (True, "true"), (float("nan"), "nan"), ("2", "'2'")):
        with pytest.raises(ConfigError) as info:
            read(value)
        msg = str(info.value)
        assert msg.startswith(f"config key '{path}' must be an integer") and msg.endswith(f"got {shown}"), msg


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
