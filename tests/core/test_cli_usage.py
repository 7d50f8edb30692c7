"""A mistyped flag of a sub-command: the error shows that sub-command's usage line (not the top-level one),
exit status 2, and the nearest option it has; the same for a mistyped sub-command name."""

from __future__ import annotations

import pytest
from polyaccel.cli import did_you_mean, main


def _usage_error(capsys, argv: list[str]) -> str:
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2
    return capsys.readouterr().err


def test_train_names_its_own_usage_and_the_nearest_flag(capsys):
    err = _usage_error(capsys, ["train", "--stpes", "20"])
    assert err.startswith("usage: polyaccel train ") and "[--steps STEPS]" in err, err
    assert "usage: polyaccel [-h] COMMAND" not in err
    want = "polyaccel train: error: unrecognized arguments: --stpes 20; did you mean --steps?"
    assert err.rstrip().endswith(want), err
    err = _usage_error(capsys, ["train", "--stpes=20", "--lrr", "0.1"])
    assert "did you mean --steps (for --stpes=20), --lr (for --lrr)?" in err, err


def test_report_and_a_nested_command_name_their_own_usage(capsys):
    err = _usage_error(capsys, ["report", "--jsn"])
    assert err.startswith("usage: polyaccel report [-h] [--json]")
    assert "polyaccel report: error: unrecognized arguments: --jsn; did you mean --json?" in err
    err = _usage_error(capsys, ["checkpoint", "verify", "some-dir", "--tga", "x"])
    assert err.startswith("usage: polyaccel checkpoint verify "), err
    assert "did you mean --tag?" in err, err


def test_nothing_close_gives_no_suggestion_and_a_mistyped_command_gets_one(capsys):
    err = _usage_error(capsys, ["report", "--zzzzzz"])
    assert "unrecognized arguments: --zzzzzz" in err and "did you mean" not in err
    err = _usage_error(capsys, ["trian"])
    assert "invalid choice: 'trian'" in err and err.rstrip().endswith("did you mean train?"), err
    assert did_you_mean("argument --steps: invalid int value: 'x'", None) == ""
