"""polyaccel.config_check: each rule, unknown keys with a did-you-mean, key paths, the caller's dict kept."""

from __future__ import annotations

import copy
import math

import pytest
from polyaccel.config_check import (
    Bool,
    Float,
    Floats,
    Int,
    OneOf,
    Regex,
    Section,
    Strings,
    Text,
    check,
    check_flag,
    integer_value,
    key_path,
)
from polyaccel.errors import ConfigError

NAN, INF = float("nan"), float("inf")


def refused(rule, value, path="sec.key") -> str:
    with pytest.raises(ConfigError) as info:
        check(value, rule, path)
    msg = str(info.value)
    assert msg.startswith(f"config key '{path}' must be {rule.describe()}, got "), msg
    return msg


# ------------------------------------------------------------------------------------------------ rules
@pytest.mark.parametrize("value, want", [(2, 2), (2.0, 2), (5e8, 500_000_000), (0, 0), (-3, -3)])
def test_integer_rule_takes_ints_and_integral_floats(value, want):
    got = check(value, Int(), "k")
    assert got == want and type(got) is int


@pytest.mark.parametrize("value", [2.5, True, False, NAN, INF, -INF, "2", None, [2]])
def test_integer_rule_refuses_the_rest(value):
    assert integer_value(value) is None
    refused(Int(), value)


def test_integer_bounds_are_inclusive():
    rule = Int(1, 3)
    assert [check(v, rule, "k") for v in (1, 3.0)] == [1, 3]
    assert "must be an integer in [1, 3], got 0" in refused(rule, 0)
    assert "must be an integer >= 1, got 0" in refused(Int(1), 0)
    assert "got 4" in refused(rule, 4)


def test_number_rule_is_finite_and_not_bool():
    assert check(3, Float(), "k") == 3.0 and type(check(3, Float(), "k")) is float
    for bad in (NAN, INF, -INF, True, "1.0", None):
        refused(Float(), bad)
    assert "a finite number >= 0, got nan" in refused(Float(0.0), NAN)


def test_number_bounds_open_and_closed():
    half_open = Float(0.0, 1.0, above=True)  # (0, 1]
    assert check(1, half_open, "k") == 1.0 and check(1e-9, half_open, "k") == 1e-9
    assert "must be a number in (0, 1], got 0" in refused(half_open, 0)
    assert "got 1.5" in refused(half_open, 1.5)
    assert check(0, Float(0.0, 1.0, below=True), "k") == 0.0
    assert "in [0, 1)" in refused(Float(0.0, 1.0, below=True), 1.0)
    assert "> 0" in refused(Float(0.0, above=True), 0.0)


def test_flag_rule_takes_only_true_and_false():
    assert check(True, Bool(), "k") is True and check(False, Bool(), "k") is False
    for bad in (1, 0, "yes", "true", None):
        assert "must be true or false" in refused(Bool(), bad)


def test_choice_rule_folds_case_and_follows_the_integer_rule():
    rule = OneOf(("adamw", "muon"))
    assert check("AdamW", rule, "k") == "adamw"
    assert "must be one of adamw, muon, got 'sgd'" in refused(rule, "sgd")
    stages = OneOf((1, 2, 3))
    assert check(2.0, stages, "k") == 2
    for bad in (2.5, True, "2", 4):
        refused(stages, bad)
    mixed = OneOf((True, False, "auto"))  # True is not 1 here
    assert check("AUTO", mixed, "k") == "auto" and check(False, mixed, "k") is False
    for bad in (1, 0, "yes"):
        assert "one of true, false, auto" in refused(mixed, bad)


def test_optional_rules_take_null_as_the_default():
    assert check(None, Int(1, optional=True), "k") is None
    assert "must be an integer >= 1 or null, got 0" in refused(Int(1, optional=True), 0)
    assert Section({"a": None}, "s", ["a"]).get("a", Int(optional=True), 7) == 7


def test_strings_texts_regexes_and_number_lists():
    assert check("x*", Strings(), "k") == ("x*",) and check(["a", "b"], Strings(), "k") == ("a", "b")
    for bad in ([""], [3], "", {"a": 1}):
        refused(Strings(), bad)
    refused(Strings(nonempty=True), [])
    refused(Text(), "")
    assert check("ok", Text(), "k") == "ok"
    with pytest.raises(ConfigError, match=r"config key 'k' is not a valid regular expression .*'\('"):
        check("(", Regex(), "k")
    assert check([0.9, 0], Floats(2, Float(0.0, 1.0, below=True)), "k") == (0.9, 0.0)
    assert "two numbers in [0, 1)" in refused(Floats(2, Float(0.0, 1.0, below=True)), [0.9, 1.0])
    assert "three finite numbers" in refused(Floats(3), [1, 2, NAN])
    refused(Floats(3), [1, 2])


def test_flag_wording_for_the_command_line():
    with pytest.raises(ConfigError, match=r"^--steps 0: must be at least 1$"):
        check_flag("--steps", 0, Int(1))
    with pytest.raises(ConfigError, match=r"^--lr nan: must be a positive finite number \(e.g. 3e-3\)$"):
        check_flag("--lr", NAN, Float(0.0, above=True), "(e.g. 3e-3)")
    with pytest.raises(ConfigError, match=r"^--offload-ratio 1.5: must be in \(0, 1\]$"):
        check_flag("--offload-ratio", 1.5, Float(0.0, 1.0, above=True))
    with pytest.raises(ConfigError, match=r"^--dtype 'int8': choose one of fp32, bf16$"):
        check_flag("--dtype", "int8", OneOf(("fp32", "bf16")))
    assert check_flag("--steps", 3, Int(1)) == 3
    assert check_flag("--dtype", "BF16", OneOf(("fp32", "bf16"))) == "bf16"


# ------------------------------------------------------------------------------------------------ sections
def test_unknown_keys_list_the_allowed_ones_and_a_guess():
    with pytest.raises(ConfigError) as info:
        Section({"zero_optimisation": {}}, "", ["zero_optimization", "optimizer"])
    assert str(info.value) == ("unknown config key 'zero_optimisation'; allowed keys: optimizer, "
                               "zero_optimization; did you mean 'zero_optimization'?")
    with pytest.raises(ConfigError) as info:
        Section({"pin_memry": True, "zzz": 1}, "a.b", ["pin_memory", "device"])
    assert str(info.value) == ("unknown config keys 'a.b.pin_memry', 'a.b.zzz'; allowed keys in 'a.b': "
                               "device, pin_memory; did you mean 'pin_memory'?")


def test_errors_name_the_full_key_path():
    cfg = {"zero_optimization": {"offload_optimizer": {"pin_memory": "no"}}}
    top = Section(cfg, "", ["zero_optimization"])
    zero = top.section("zero_optimization", ["offload_optimizer"])
    offload = zero.section("offload_optimizer", ["pin_memory"])
    with pytest.raises(ConfigError, match=r"^config key 'zero_optimization.offload_optimizer.pin_memory' "
                                          r"must be true or false, got 'no'$"):
        offload.get("pin_memory", Bool())
    specs = Section({"specs": [{"x": 1}, {"x": 2.5}]}, "tp", ["specs"]).items("specs")
    assert [p for p, _ in specs] == ["tp.specs[0]", "tp.specs[1]"]
    with pytest.raises(ConfigError, match=r"config key 'tp.specs\[1\].x' must be an integer"):
        Section(specs[1][1], specs[1][0], ["x"]).get("x", Int())
    with pytest.raises(ConfigError, match=r"^config key 'a.b' must be a dict, got list$"):
        Section([], "a.b", [])
    assert key_path("", "a") == "a" and key_path("a", "b") == "a.b" and key_path("a", 0) == "a[0]"
    with pytest.raises(ConfigError, match=r"config key 's.n' is required: the count"):
        Section({}, "s", ["n"]).require("n", "the count")


def test_the_callers_dict_is_never_changed():
    cfg = {"a": {"names": ["x", "y"], "n": 2.0, "flag": True}, "b": None}
    before = copy.deepcopy(cfg)
    top = Section(cfg, "", ["a", "b"])
    got = top.section("a", ["names", "n", "flag"]).values({"names": Strings(), "n": Int(), "flag": Bool()})
    assert top.section("b", []).values({}) == {}
    assert got == {"names": ("x", "y"), "n": 2, "flag": True}
    assert cfg == before and isinstance(cfg["a"]["n"], float) and cfg["b"] is None
    cfg["a"]["names"].append("z")  # what came back shares nothing mutable with the caller's dict
    assert got["names"] == ("x", "y")


def test_values_keep_present_keys_only():
    sec = Section({"x": 1, "y": None}, "s", ["x", "y", "z"])
    assert sec.values({"x": Int(), "y": Int(optional=True), "z": Int()}) == {"x": 1}
    assert "x" in sec and "z" not in sec and math.isnan(Section({"q": NAN}, "", ["q"]).raw("q"))


def test_importing_the_checks_loads_no_torch():
    import subprocess
    import sys

    code = "import sys, polyaccel.config_check; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"  # a config is checked before anything heavy is imported


def test_a_mistyped_choice_gets_a_guess():
    with pytest.raises(ConfigError, match=r"^config key 'o.type' must be one of adamw, lion, got 'adamv'; "
                                          r"did you mean 'adamw'\?$"):
        check("adamv", OneOf(("adamw", "lion")), "o.type")


def test_a_rule_must_say_what_it_wants_and_how_it_parses():
    import pytest
    from polyaccel.config_check import Rule

    with pytest.raises(TypeError, match="abstract"):
        Rule()

    class Half(Rule):  # only one of the two
        def _what(self):
            return "half"

    with pytest.raises(TypeError, match="_parse"):
        Half()
