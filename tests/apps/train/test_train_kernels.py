"""`polyaccel train --kernels`: the option's default and values, and a run with the kernels swapped in (one rank
on the cpu plugin)."""

import argparse
import json
from types import SimpleNamespace

import polyaccel
import pytest
from polyaccel.apps.train.command import add_arguments
from polyaccel.apps.train.kernels import resolve
from polyaccel.apps.train.options import options_from_args
from polyaccel.cli import main

pytestmark = pytest.mark.timeout(240)

TINY = ["--hidden-size", "64", "--layers", "1", "--heads", "2", "--batch-size", "2", "--seq-len", "16",
        "--threads", "1", "--lr", "1e-2", "--nproc", "1"]


def _options(*argv):
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return options_from_args(parser.parse_args(list(argv)), polyaccel.get_accelerator())


def test_the_default_is_auto_on_a_device_and_off_on_the_cpu_plugin():
    assert resolve(None, SimpleNamespace(device_type="cuda")) == "auto"
    assert resolve(None, SimpleNamespace(device_type="cpu")) == "off"
    assert _options().kernels == "off" and "kernels" not in _options().engine_config()
    assert _options("--kernels").engine_config()["kernels"] == "auto"  # the flag alone
    assert _options("--kernels", "all").engine_config()["kernels"] is True
    assert "kernels" not in _options("--kernels", "off").engine_config()


def test_a_run_with_kernels_swaps_them_and_learns(capfd, tmp_path):
    """(That the swapped model computes what Hugging Face's does is tests/engines/kernels' job; one launch here.)"""
    out = tmp_path / "all.json"
    assert main(["train", *TINY, "--steps", "6", "--kernels", "all", "--metrics-out", str(out)]) == 0, \
        capfd.readouterr().err
    assert "rms_norm x3, rope x1, swiglu x1, cross_entropy x1" in " ".join(capfd.readouterr().out.split())
    res = json.loads(out.read_text())
    swapped = {k: v["swapped"] for k, v in res["kernels"]["kernels"].items()}
    assert swapped == {"rms_norm": 3, "rope": 1, "swiglu": 1, "cross_entropy": 1}, res["kernels"]
    assert res["kernels"]["left_alone"] == {}
    assert res["losses"][-1] < res["losses"][0] - 0.3, res["losses"]
