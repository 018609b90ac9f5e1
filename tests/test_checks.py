"""edgespec.checks: the shared checks of handed-over values (bool is no integer, bounds named)."""
from __future__ import annotations

import math

import numpy as np
import pytest

from edgespec.checks import integer, is_int, is_number, number, one_of
from edgespec.errors import ConfigError, ExportError


@pytest.mark.parametrize("value, want", [(3, True), (np.int64(3), True), (True, False), (np.bool_(True), False),
                                         (3.0, False), ("3", False), (None, False)])
def test_is_int_takes_integers_but_not_bools(value, want):
    assert is_int(value) is want


@pytest.mark.parametrize("value, want", [(3, True), (2.5, True), (np.float32(1), True), (math.nan, True),
                                         (False, False), ("2.5", False)])
def test_is_number_takes_reals_but_not_bools(value, want):
    assert is_number(value) is want


def test_integer_returns_a_plain_int_within_its_bounds():
    got = integer(np.int32(4), "threads", least=1, most=8)
    assert got == 4 and type(got) is int


@pytest.mark.parametrize("value, least, most, says", [
    (True, 1, None, "threads must be an integer >= 1, got True"),
    (0, 1, None, "threads must be an integer >= 1, got 0"),
    (9, 1, 8, "threads must be an integer in 1..8, got 9"),
    ("4", None, 8, "threads must be an integer <= 8, got '4'"),
    (2.0, None, None, "threads must be an integer, got 2.0"),
])
def test_integer_names_the_bound_it_missed(value, least, most, says):
    with pytest.raises(ConfigError) as e:
        integer(value, "threads", least=least, most=most)
    assert str(e.value) == says


def test_the_error_type_is_the_callers():
    with pytest.raises(ExportError, match="^block_count must be an integer >= 1, got -2$"):
        integer(-2, "block_count", least=1, error=ExportError)
    with pytest.raises(ValueError, match="ms"):
        number(math.inf, "ms", above=0, error=ValueError)


@pytest.mark.parametrize("value, kw, says", [
    (math.nan, {"least": 0}, "top_p must be a finite number >= 0, got nan"),
    (0, {"above": 0, "most": 1}, "top_p must be a finite number > 0 and <= 1, got 0"),
    (1.5, {"least": 0, "most": 1}, "top_p must be a finite number in 0..1, got 1.5"),
    (False, {}, "top_p must be a finite number, got False"),
])
def test_number_refuses_non_finite_bools_and_out_of_bounds(value, kw, says):
    with pytest.raises(ConfigError) as e:
        number(value, "top_p", **kw)
    assert str(e.value) == says


def test_number_returns_a_float():
    got = number(np.float32(0.5), "top_p", above=0, most=1)
    assert got == 0.5 and type(got) is float


def test_one_of_names_the_choices():
    assert one_of("cpu", "device", ("cpu", "gpu")) == "cpu"
    with pytest.raises(ConfigError, match="^device must be one of cpu, gpu, got 'npu'$"):
        one_of("npu", "device", ("cpu", "gpu"))
    with pytest.raises(ConfigError, match="got 3"):
        one_of(3, "device", ("cpu", "gpu"))
