"""rlaxkit.rules.validation: an integer is an ``int`` that is not a ``bool``."""

import enum
import math

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from rlaxkit.rules.validation import check_int, is_int, is_number


class Colour(enum.IntEnum):
    RED = 1


NOT_NUMBERS = st.one_of(
    st.none(), st.text(max_size=3), st.lists(st.integers(), max_size=2), st.complex_numbers()
)
NUMPY_INTEGERS = st.integers(-(2**31), 2**31 - 1).flatmap(
    lambda n: st.sampled_from([np.int8(n % 100), np.int32(n), np.int64(n), np.uint32(abs(n))])
)
ANYTHING = st.one_of(
    st.integers(),
    st.booleans(),
    st.floats(allow_nan=True, allow_infinity=True),
    NOT_NUMBERS,
    NUMPY_INTEGERS,
    st.sampled_from([np.bool_(True), np.float64(2.0), np.float32(1.5), Colour.RED]),
)


@given(st.integers())
def test_every_int_is_an_int_and_a_number(value):
    assert is_int(value) and is_int(value, numpy=True) and is_number(value)


@given(st.booleans())
def test_a_bool_is_neither(value):
    for flag in (value, np.bool_(value)):
        assert not is_int(flag) and not is_int(flag, numpy=True) and not is_number(flag)


@given(st.floats(allow_nan=True, allow_infinity=True))
def test_a_float_is_a_number_but_not_an_int(value):
    # NaN and infinities included: callers that want finite numbers test math.isfinite.
    assert is_number(value) and not is_int(value) and not is_int(value, numpy=True)


@given(NUMPY_INTEGERS)
def test_numpy_integers_count_only_when_asked(value):
    assert is_int(value, numpy=True) and not is_int(value) and not is_number(value)


@given(ANYTHING)
def test_predicates_match_the_isinstance_spelling_they_replace(value):
    assert is_int(value) == (not (isinstance(value, bool) or not isinstance(value, int)))
    assert is_int(value, numpy=True) == (
        not (isinstance(value, bool) or not isinstance(value, int | np.integer))
    )
    assert is_number(value) == (not (isinstance(value, bool) or not isinstance(value, int | float)))


@given(ANYTHING, st.one_of(st.none(), st.integers(-5, 5)))
def test_check_int_returns_the_value_or_raises_naming_field_rule_and_value(value, minimum):
    ok = is_int(value) and (minimum is None or value >= minimum)
    if ok:
        assert check_int("field", value, minimum=minimum) is value
        return
    allowed = "an integer" if minimum is None else f"an integer >= {minimum}"
    with pytest.raises(ValueError) as error:
        check_int("field", value, minimum=minimum)
    assert str(error.value) == f"field: must be {allowed}, got {value!r}"


@given(st.integers(-3, 3))
def test_check_int_uses_the_callers_wording(value):
    # ray_config and the parameter servers say "an int", with a gloss in brackets.
    allowed = "an int >= 1 (versions retained)"
    if value >= 1:
        assert check_int("keep", value, minimum=1, allowed=allowed) == value
    else:
        with pytest.raises(ValueError, match=r"^keep: must be an int >= 1 \(versions retained\), "):
            check_int("keep", value, minimum=1, allowed=allowed)


def test_check_int_numpy():
    assert check_int("process_id", np.int64(2), minimum=0, numpy=True) == 2
    with pytest.raises(ValueError, match=r"^process_id: must be an integer >= 0, got "):
        check_int("process_id", np.int64(2), minimum=0)
    with pytest.raises(ValueError, match=r"^seed: must be an integer, got nan$"):
        check_int("seed", math.nan)


def test_int_subclasses_other_than_bool_are_ints():
    assert is_int(Colour.RED) and check_int("colour", Colour.RED, minimum=1) is Colour.RED
