"""affdiv.checks: the one integer check every subpackage uses, and the CLI's naming of flags."""

import argparse

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from affdiv import cli
from affdiv.checks import NonFiniteError, check_int, is_int


@given(st.integers(min_value=-10**30, max_value=10**30), st.integers(min_value=-5, max_value=5))
def test_an_integer_passes_exactly_when_it_reaches_the_minimum(value, minimum):
    assert is_int(value, minimum) == (value >= minimum)
    if value >= minimum:
        assert check_int("n", value, minimum=minimum) == value
    else:
        with pytest.raises(ValueError, match=rf"^n must be an integer >= {minimum}, got {value}$"):
            check_int("n", value, minimum=minimum)


@pytest.mark.parametrize("value", [True, False, 1.0, 2.5, "3", None, [1]])
def test_a_bool_a_float_or_text_is_not_an_integer(value):
    assert not is_int(value)
    with pytest.raises(ValueError, match=rf"^workers must be an integer >= 1, got {value!r}$".replace("[", r"\[")
                       .replace("]", r"\]")):
        check_int("workers", value)


def test_numpy_integers_count_and_come_back_as_int():
    out = check_int("seed", np.int64(7), minimum=0)
    assert out == 7 and type(out) is int


def test_an_upper_end_is_part_of_the_range():
    assert check_int("seed", 2**64 - 1, minimum=0, maximum=2**64 - 1) == 2**64 - 1
    with pytest.raises(ValueError, match=rf"^seed must be an integer in \[0, {2**64 - 1}\], got {2**64}$"):
        check_int("seed", 2**64, minimum=0, maximum=2**64 - 1)


def test_one_non_finite_error_is_both_arithmetic_and_a_value_error():
    from affdiv import reporting
    from affdiv.experiments.analysis import stats

    assert reporting.NonFiniteError is stats.NonFiniteError is NonFiniteError
    assert issubclass(NonFiniteError, ArithmeticError) and issubclass(NonFiniteError, ValueError)


def _parser():
    parser = argparse.ArgumentParser(prog="affdiv")
    sub = parser.add_subparsers(dest="command")
    falsify = sub.add_parser("falsify")
    falsify.add_argument("--calibration-sims", type=int)
    falsify.add_argument("-o", "--out")
    return parser


@pytest.mark.parametrize(("message", "shown"), [
    ("calibration_sims must be an integer >= 0, got -1", "--calibration-sims must be an integer >= 0, got -1"),
    ("out /x: exists and is not a folder", "--out /x: exists and is not a folder"),
    ("calibration_simsX must be", "calibration_simsX must be"),  # a longer word is not the parameter
    ("unknown preset 'smok'", "unknown preset 'smok'"),  # no parameter leads: as it is
])
def test_the_cli_names_the_flag_of_the_parameter_a_message_opens_with(message, shown):
    options = cli.options_of(_parser(), "falsify")
    assert options["calibration_sims"] == "--calibration-sims" and options["out"] == "--out"
    assert cli.flag_named(message, options) == shown
