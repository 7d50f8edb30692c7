"""The engine and model-layer contracts (polyaccel.contracts) and their discovery (polyaccel.extensions):
the real ZeRO engine and both layers satisfy them; a broken engine or layer entry point is isolated with
the reason, shown by `polyaccel report`, and breaks neither the others nor initialize for them."""

import contextlib
import json

import polyaccel
import pytest
import torch
from polyaccel.cli import main as cli_main
from polyaccel.contracts import EngineFactory, ModelLayer, TrainingEngine, contract_mismatch
from polyaccel.engine_entry import layer_mesh_sizes, load_engine
from polyaccel.errors import ConfigError, PolyaccelError
from polyaccel.extensions import ENGINE_GROUP, LAYER_GROUP, discover_extensions
from polyaccel.testing.distributions import temporary_distribution

BROKEN_IMPORT = "raise ImportError('pa_contract_missing_dep is not installed')\n"

LAYER_WITHOUT_APPLY = '''
ORDER = "late"


def mesh_sizes(section):
    return {}
'''

ENGINE_WITH_OLD_STEP = '''
class OldEngine:
    def __call__(self, *args, **kwargs):
        pass

    def backward(self, loss, retain_graph=False):
        return loss

    def step(self):  # no boundary=: a trainer's short last window could not be stepped
        return True


def initialize(model, config=None, **kwargs) -> OldEngine:
    return OldEngine()
'''

ENGINE_RETURNING_LESS = '''
class Half:
    def step(self, boundary=None):
        return True


def initialize(model, config=None, **kwargs):  # no annotation: only the built object shows what it lacks
    return Half()
'''


@pytest.fixture
def installed(tmp_path):
    """Install one fake distribution with the given entry points and modules for the test."""
    with contextlib.ExitStack() as stack:
        def _install(entry_points, modules, name="pa-contract-test"):
            stack.enter_context(temporary_distribution(tmp_path / name, name, entry_points, modules))
        yield _install


def _records(group):
    return {r.name: r for r in discover_extensions(group)}


# ------------------------------------------------------------------- the real ones satisfy their contracts
def test_the_zero_engine_and_both_layers_satisfy_their_protocols():
    import polyaccel.engines.autoep.layer as autoep
    import polyaccel.engines.autotp.layer as autotp
    from polyaccel.engines.zero import ZeroEngine, initialize

    assert contract_mismatch(ZeroEngine, TrainingEngine, attributes=False) == []
    assert contract_mismatch(initialize, EngineFactory) == []
    for layer in (autotp, autoep):
        assert contract_mismatch(layer, ModelLayer) == []
        assert isinstance(layer, ModelLayer)


def test_the_structural_check_names_each_missing_or_different_member():
    class Engine:
        def __call__(self, x):
            return x

        def step(self):
            return True

        def backward(self, loss, retain_graph=False, *, scale):
            return loss

    problems = contract_mismatch(Engine, TrainingEngine, attributes=False)
    assert "step takes no parameter 'boundary'" in problems
    assert "backward requires parameter 'scale' the contract does not pass" in problems
    assert "no method 'zero_grad'" in problems and "no method 'load_checkpoint'" in problems
    assert not any(p.startswith("calling it") for p in problems)  # a forward's own arguments are the model's
    assert contract_mismatch(Engine(), TrainingEngine)[:1] == ["no attribute 'device'"]
    assert contract_mismatch(lambda: None, EngineFactory) == ["calling it takes no parameter 'model', 'config'"]


# ------------------------------------------------------------------- broken ones are isolated and reported
def test_a_broken_layer_is_isolated_reported_and_refused_only_where_named(installed, capsys):
    installed({LAYER_GROUP: {"broken_layer": "pa_contract_broken", "shapeless_layer": "pa_contract_shapeless"}},
              {"pa_contract_broken.py": BROKEN_IMPORT, "pa_contract_shapeless.py": LAYER_WITHOUT_APPLY})
    records = _records(LAYER_GROUP)
    assert records["broken_layer"].status == "failed"
    assert records["broken_layer"].reason == "import failed: ImportError: pa_contract_missing_dep is not installed"
    assert records["shapeless_layer"].status == "failed"
    assert "no method 'apply'" in records["shapeless_layer"].reason
    assert "ORDER must be an int, got 'late'" in records["shapeless_layer"].reason
    assert records["tensor_parallel"].status == records["expert_parallel"].status == "loaded"

    # the real layers still work beside them; naming a broken one is refused with its reason
    assert layer_mesh_sizes({"tensor_parallel": {"autotp_size": 1}}) == {"tensor": 1}
    config = {"broken_layer": {}, "tensor_parallel": {"autotp_size": 1}}
    with pytest.raises(ConfigError, match="config key 'broken_layer' turns on the model layer .*isolated: import "
                                          "failed: ImportError: pa_contract_missing_dep is not installed"):
        layer_mesh_sizes(config)
    assert config == {"broken_layer": {}, "tensor_parallel": {"autotp_size": 1}}  # the caller's dict untouched

    cli_main(["report", "--json"])
    rep = json.loads(capsys.readouterr().out)
    layers = {entry["name"]: entry for entry in rep["layers"]}
    assert layers["broken_layer"]["status"] == "failed"
    assert "pa_contract_missing_dep" in layers["broken_layer"]["reason"]
    assert layers["tensor_parallel"]["status"] == "loaded"
    cli_main(["report"])
    text = " ".join(capsys.readouterr().out.split())  # the report wraps long reasons on word boundaries
    assert "shapeless_layer failed" in text and "no method 'apply'" in text


def test_a_broken_engine_is_isolated_and_the_others_still_load(installed, capsys):
    installed({ENGINE_GROUP: {"old": "pa_contract_old:initialize", "gone": "pa_contract_gone:initialize"}},
              {"pa_contract_old.py": ENGINE_WITH_OLD_STEP, "pa_contract_gone.py": BROKEN_IMPORT})
    records = _records(ENGINE_GROUP)
    assert records["gone"].status == "failed" and records["gone"].traceback
    assert records["old"].status == "failed"
    assert "its engine class OldEngine step takes no parameter 'boundary'" in records["old"].reason
    assert records["zero"].status == "loaded"

    from polyaccel.engines.zero import initialize
    assert load_engine("zero") is initialize
    with pytest.raises(PolyaccelError, match=r"engine 'old' \(entry point pa_contract_old:initialize "
                                             r"\(pa-contract-test 1.0\)\) is isolated: does not satisfy"):
        load_engine("old")
    with pytest.raises(PolyaccelError, match="no engine named 'nope'.*found: \\['gone', 'old', 'zero'\\]"):
        load_engine("nope")

    cli_main(["report", "--json"])
    engines = {entry["name"]: entry["status"] for entry in json.loads(capsys.readouterr().out)["engines"]}
    assert engines == {"zero": "loaded", "old": "failed", "gone": "failed"}


def test_an_engine_whose_object_lacks_the_contract_is_refused_by_initialize(installed):
    installed({ENGINE_GROUP: {"half": "pa_contract_half:initialize"}}, {"pa_contract_half.py": ENGINE_RETURNING_LESS})
    assert _records(ENGINE_GROUP)["half"].status == "loaded"  # nothing to see before it builds one
    with pytest.raises(PolyaccelError, match="engine 'half' returned a Half, which does not satisfy polyaccel."
                                             "contracts.TrainingEngine: no attribute 'device'.*no method 'zero_grad'"):
        polyaccel.initialize(torch.nn.Linear(2, 2), engine="half")


def test_a_second_distribution_claiming_an_engine_name_is_a_duplicate(installed):
    installed({ENGINE_GROUP: {"zero": "pa_contract_half:initialize"}}, {"pa_contract_half.py": ENGINE_RETURNING_LESS})
    zero = [r for r in discover_extensions(ENGINE_GROUP) if r.name == "zero"]
    assert [r.status for r in zero] == ["loaded", "duplicate"]
    assert "also provided by entry point polyaccel.engines.zero:initialize" in zero[1].reason
    assert zero[1].obj is None
