"""Mix refs (``adapters.mixes``, #30 item 1): any finite weight survives ``mix_ref`` -> ``parse_mix`` bit for bit
(``1e+16``'s exponent sign once split the ref), hand-written refs still parse, and ``validate_mix`` refuses
weights that are not finite or beyond ``MAX_MIX_WEIGHT``, naming the part and the bound. No numpy, no JAX:
the router runs this code in the base install."""

from __future__ import annotations

import math
import sys

import grpc
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from loraserve.adapters.errors import AdapterError
from loraserve.adapters.mixes import MAX_MIX_WEIGHT, MixPart, mix_ref, parse_mix, validate_mix
from loraserve.adapters.refs import ALIAS_RE, NAME_RE

NAMES = st.from_regex(NAME_RE, fullmatch=True)
REFS = st.one_of(
    NAMES,
    st.tuples(NAMES, st.integers(1, 10**9 - 1)).map(lambda t: f"{t[0]}@{t[1]}"),
    st.tuples(NAMES, st.from_regex(ALIAS_RE, fullmatch=True)).map(lambda t: f"{t[0]}@{t[1]}"),
)
FINITE = st.floats(allow_nan=False, allow_infinity=False)
BOUNDED = st.floats(-MAX_MIX_WEIGHT, MAX_MIX_WEIGHT, allow_nan=False)
# exponents both ways, the signs of zero, the smallest subnormal, the largest subnormal and normal, 0.1 + 0.2
EDGES = (1e16, -1e16, 1e300, 1e-5, -0.0, 0.0, 5e-324, -5e-324, 2.225073858507201e-308, sys.float_info.max)
EDGES += (sys.float_info.min, 0.1 + 0.2, 1 / 3, MAX_MIX_WEIGHT, -MAX_MIX_WEIGHT)
REFUSED = (math.nan, math.inf, -math.inf, 1e16, -1e16, sys.float_info.max, -100.5)
REFUSED += (math.nextafter(MAX_MIX_WEIGHT, math.inf),)  # the first float past the bound


def bits(parts) -> list[tuple[str, str]]:
    """Each part's ref and its weight's exact bits (``float.hex`` tells -0.0 from 0.0)."""
    return [(p.ref, float(p.weight).hex()) for p in parts]


@settings(max_examples=300, deadline=None)
@given(st.lists(st.tuples(REFS, st.one_of(BOUNDED, FINITE)), min_size=1, max_size=6))
def test_any_finite_weight_round_trips_exactly(items) -> None:
    parts = tuple(MixPart(ref, weight) for ref, weight in items)
    back = parse_mix(mix_ref(parts))
    assert back == parts and bits(back) == bits(parts)


@settings(max_examples=100, deadline=None)
@given(st.lists(st.tuples(REFS, BOUNDED), min_size=1, max_size=4, unique_by=lambda t: t[0]))
def test_bounded_weights_of_distinct_refs_are_served(items) -> None:
    parts = tuple(MixPart(ref, weight) for ref, weight in items)
    if any(p.weight != 0 for p in parts):
        validate_mix(parse_mix(mix_ref(parts)), max_mix=4)


@pytest.mark.parametrize("weight", EDGES, ids=repr)
def test_edge_weights_round_trip(weight: float) -> None:
    parts = (MixPart("a@1", weight), MixPart("b", 0.5))
    ref = mix_ref(parts)
    assert ref.count("+") == 1, ref  # the one between the parts: no exponent's sign
    assert bits(parse_mix(ref)) == bits(parts)


def test_mix_ref_text_and_hand_written_refs() -> None:
    assert mix_ref([MixPart("a", 1e16), MixPart("b@2", -1.5e-7)]) == "a*1e16+b@2*-1.5e-07"
    assert mix_ref([MixPart("a@1", 0.7), MixPart("b", -0.3)]) == "a@1*0.7+b*-0.3"  # unchanged
    written = {
        "a*0.7+b*0.3": [("a", 0.7), ("b", 0.3)],
        "a*1e+16+b@2*-3E+1": [("a", 1e16), ("b@2", -30.0)],  # an exponent's `+`, as Python prints it
        "a*+0.5+b@prod*.25": [("a", 0.5), ("b@prod", 0.25)],  # an explicit sign
        "a*2": [("a", 2.0)],
    }
    for ref, parts in written.items():
        assert [(p.ref, p.weight) for p in parse_mix(ref)] == parts, ref
    for bad in ("a*x", "a+b*1", "a", "a*1e+", "a*1+"):
        with pytest.raises(AdapterError) as err:
            parse_mix(bad)
        assert err.value.code == grpc.StatusCode.INVALID_ARGUMENT


@pytest.mark.parametrize("weight", REFUSED, ids=repr)
def test_weights_not_finite_or_beyond_the_bound_are_refused(weight: float) -> None:
    """Named part, the bound in the message; also when the weight came through a mix ref (the worker's path),
    where ``1e+16`` was "not a number"."""
    parts = (MixPart("fine", 0.5), MixPart("big-one@2", weight))
    for given_parts in (parts, parse_mix(mix_ref(parts))):
        with pytest.raises(AdapterError) as err:
            validate_mix(given_parts, max_mix=4)
        assert err.value.code == grpc.StatusCode.INVALID_ARGUMENT
        message = err.value.message
        assert "'big-one@2'" in message and "finite" in message and f"±{MAX_MIX_WEIGHT:g}" in message
    validate_mix((MixPart("fine", 0.5), MixPart("big-one@2", math.copysign(MAX_MIX_WEIGHT, weight))), 4)


def test_the_bound_is_documented() -> None:
    from loraserve.adapters import mixes

    assert MAX_MIX_WEIGHT == 100.0 and "MAX_MIX_WEIGHT" in (mixes.__doc__ or "")
