"""``adapters.patterns``: PEFT's rank_pattern / alpha_pattern lookup, in linear time, within bounds.

The lookup must agree with PEFT's own function (``peft.utils.other.get_pattern_key``) on the keys PEFT users
write, decide or refuse a catastrophic key at once (Python's ``re`` takes minutes on some), and refuse keys
over the bounds with INVALID_ARGUMENT naming the field.
"""

from __future__ import annotations

import json
import time

import grpc
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from peft.utils.other import get_pattern_key

from loraserve.adapters import patterns
from loraserve.adapters.errors import AdapterError
from loraserve.adapters.peft import _pattern_value, parse_config

MODULES = {
    "self_attn": ("q_proj", "k_proj", "v_proj", "o_proj"),
    "mlp": ("gate_proj", "up_proj", "down_proj"),
}
# a Llama's module paths as PEFT names them (``model.named_modules()`` of LlamaForCausalLM)
LLAMA_PATHS = [
    f"model.layers.{layer}.{block}.{module}"
    for layer in range(32)
    for block, modules in MODULES.items()
    for module in modules
] + ["model.embed_tokens", "lm_head"]

# what users put in rank_pattern / alpha_pattern (PEFT's docs, the Hub's adapter_config.json files)
TABLE = [
    {"q_proj": 2},
    {"layers.0.self_attn.q_proj": 2},
    {"model.layers.3.self_attn.q_proj": 5},
    {r".*\.mlp\..*": 4},
    {r"layers\.[0-3]\..*": 3},
    {"k_proj|v_proj": 6},
    {r"layers\.(1|2)\.self_attn\.(q|k)_proj": 7},
    {"q_proj": 1, "layers.0.self_attn.q_proj": 9},  # the first key that matches wins
    {"layers.0.self_attn.q_proj": 9, "q_proj": 1},
    {r".*\.mlp\..*": 4, "down_proj": 8, r"layers\.[0-3]\..*": 3},
    {"proj": 2, "self_attn": 3, "layers": 4},  # a key matches whole dotted names: these match nothing
    {"embed_tokens": 2, "lm_head": 3},
    {r"layers\.\d+\.mlp\.up_proj": 8},
    {r"model\.layers\.1\d\..*": 2},
    {"^model.*q_proj$": 2},
    {"[qk]_proj": 2, "[^q]_proj": 3},
    {"(?i:Q_PROJ)": 2},
    {"q_proj.*": 2},
    {"layers.1.*": 4},
    {"": 1},
    {r"model\.layers\.(?:[0-9]|1[0-5])\.mlp\.(?:gate|up)_proj": 16, r".*_proj": 2},
    {"layers.2[0-9].self_attn.[qkv]_proj": 12},
    {r"\w+\.\w+": 5, r"[a-z]+\.\d+\.[a-z_]+\.[a-z_]+": 6},
    {r"(?:model\.)?layers\.3\.self_attn\.q_proj": 2, r"(model\.)?lm_head": 7},
]


def peft_value(pattern: dict, path: str, default: int) -> int:
    """What PEFT's LoraModel gives the module (``_create_and_replace``)."""
    return pattern.get(get_pattern_key(pattern.keys(), path), default)


@pytest.mark.parametrize("pattern", TABLE, ids=[json.dumps(p) for p in TABLE])
def test_agrees_with_peft_on_a_llama(pattern: dict) -> None:
    patterns.check_patterns("rank_pattern", pattern)
    for path in LLAMA_PATHS:
        assert _pattern_value(pattern, path, -1) == peft_value(pattern, path, -1), path


# keys built from the pieces users combine: names, escaped and bare dots, digits, classes, groups, anchors
_NAMES = [
    "model",
    "layers",
    "self_attn",
    "mlp",
    "q_proj",
    "k_proj",
    "down_proj",
    "gate_proj",
    "proj",
    "lm_head",
]
_PIECES = [
    *_NAMES,
    *(str(i) for i in (0, 1, 3, 12, 31)),
    r"\.",
    ".",
    ".*",
    r"\d+",
    r"\d",
    "[0-3]",
    "[qk]",
    r"[^.]*",
    r"\w+",
    "(q|k|v)_proj",
    "(self_attn|mlp)",
    "(?:1|2)",
    "_",
    "x?",
]
keys = st.lists(st.sampled_from(_PIECES), min_size=1, max_size=7).map("".join)
alternations = st.lists(keys, min_size=1, max_size=3).map("|".join)
pattern_dicts = st.dictionaries(alternations, st.integers(1, 64), min_size=1, max_size=4)


@settings(max_examples=120, deadline=None)
@given(pattern=pattern_dicts)
def test_agrees_with_peft_on_generated_keys(pattern: dict) -> None:
    patterns.check_patterns("alpha_pattern", pattern)  # the subset users write is never refused
    for path in LLAMA_PATHS[:14] + LLAMA_PATHS[-16:]:  # layers 0, 1, 30, 31 and the vocabulary modules
        assert _pattern_value(pattern, path, -1) == peft_value(pattern, path, -1), path


def test_keys_one_by_one_agree_with_the_set(monkeypatch: pytest.MonkeyPatch) -> None:
    """The fallback (each key alone, when the RE2 set cannot be built or runs out of memory) gives the set's
    answers."""
    together = [[patterns.pattern_key(p, path) for path in LLAMA_PATHS] for p in TABLE]
    patterns._compile_all.cache_clear()
    monkeypatch.setattr(patterns._Compiled, "_set", staticmethod(lambda keys: None))
    try:
        alone = [[patterns.pattern_key(p, path) for path in LLAMA_PATHS] for p in TABLE]
    finally:
        patterns._compile_all.cache_clear()
    assert alone == together


CATASTROPHIC = [
    "(a+)+$",
    "(a|a)*b",
    "(.*){20}x",
    "(.*)*x",
    "(.|.)*x",
    "(.*.*)*x",
    "([a-z_.0-9]+)*x",
    "(x+x+)+y",
]
LONG_PATHS = [
    "model.layers.31.self_attn.q_proj",
    "model.layers.0." + "a" * 5000 + "!",
    "model." + "x" * 4000 + ".q_proj",
]


@pytest.mark.parametrize("key", CATASTROPHIC)
def test_a_catastrophic_key_is_decided_at_once(key: str) -> None:
    """Python's re takes minutes (or far longer) on these against a module path; RE2 decides in
    microseconds. The bound is for safety, not speed."""
    start = time.perf_counter()
    patterns.check_patterns("rank_pattern", {key: 2})
    answers = [patterns.pattern_key({key: 2}, path) for path in LONG_PATHS]
    assert time.perf_counter() - start < 1.0
    assert answers[0] is None  # nothing in a Llama ends in x, b or y


@pytest.mark.parametrize("key", ["(.{1,100}){10}x", "(.{1,50}){20}", "[^.]{1000}"])
def test_a_key_too_large_for_linear_time_is_refused_at_once(key: str) -> None:
    start = time.perf_counter()
    with pytest.raises(AdapterError) as exc:
        patterns.check_patterns("rank_pattern", {key: 2})
    assert time.perf_counter() - start < 1.0
    assert exc.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert "rank_pattern" in exc.value.message and key[:20] in exc.value.message


@pytest.mark.parametrize(
    ("key", "why"),
    [
        ("(", "not a regular expression PEFT accepts"),  # PEFT would raise too
        ("[[:digit:]]", "not a regular expression PEFT accepts"),  # Python: a nested set; RE2: a class
        (r"\1x", "linear time"),  # a backreference
        ("(?=q)q_proj", "linear time"),  # a lookahead
        ("(?>q_proj)", "linear time"),  # an atomic group
        ("q_proj++", "linear time"),  # a possessive repeat
        ("q{,3}_proj", "{0,n}"),  # Python: 0 to 3; RE2: the text "{,3}"
    ],
)
def test_keys_read_differently_or_not_in_linear_time_are_refused(key: str, why: str) -> None:
    with pytest.raises(AdapterError) as exc:
        patterns.check_patterns("alpha_pattern", {"q_proj": 2, key: 3})
    assert exc.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert f"alpha_pattern[{key!r}]" in exc.value.message and why in exc.value.message


def _config(**fields) -> bytes:
    return json.dumps({"peft_type": "LORA", "r": 4, "lora_alpha": 8, **fields}).encode()


@pytest.mark.parametrize("field", ["rank_pattern", "alpha_pattern"])
def test_bounds_are_refused_naming_the_field(field: str) -> None:
    long_key = "layers.0.self_attn." + "q" * patterns.MAX_KEY_CHARS
    with pytest.raises(AdapterError) as exc:
        parse_config(_config(**{field: {"q_proj": 2, long_key: 2}}))
    assert f"{field}[" in exc.value.message and f"at most {patterns.MAX_KEY_CHARS}" in exc.value.message
    many = {f"model.layers.{i}.self_attn.q_proj": 2 for i in range(patterns.MAX_KEYS + 1)}
    with pytest.raises(AdapterError) as exc:
        parse_config(_config(**{field: many}))
    assert (
        exc.value.message == f"{field}: {patterns.MAX_KEYS + 1} keys; at most {patterns.MAX_KEYS} are allowed"
    )
    # each key small enough, together too large to compile
    big = {f"(.*){{100}}x{i}": 2 for i in range(200)}
    with pytest.raises(AdapterError) as exc:
        parse_config(_config(**{field: big}))
    assert f"{field}[" in exc.value.message and "RE2 instructions" in exc.value.message
    # at the bounds: accepted
    at = {f"model.layers.{i}.self_attn.q_proj": 2 for i in range(patterns.MAX_KEYS - 1)}
    at["q" * patterns.MAX_KEY_CHARS] = 3
    assert parse_config(_config(**{field: at}))[field] == at


def test_a_peft_adapter_with_patterns_parses_to_peft_ranks_and_scalings(llama_dir, tmp_path) -> None:
    """An adapter PEFT saved with overlapping rank and alpha patterns, loaded back by PEFT: every module's
    rank and scaling (alpha / r) as parsed equal the loaded model's (a wrong rank would not even parse).

    PEFT writes ``adapter_config.json`` with sorted keys, so the first key that matches is the first in
    sorted order once saved (here ``down_proj`` before ``layers\\.1\\..*``): PEFT's own loading and this
    parser agree on that, even where the model PEFT trained had used the other key."""
    import numpy as np
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from loraserve.adapters.files import read_adapter_files
    from loraserve.adapters.peft import parse_adapter
    from loraserve.testing import make_adapter

    rank_pattern = {r"layers\.0\.self_attn\.(q|k)_proj": 2, r".*\.mlp\..*": 6, "q_proj": 3}
    alpha_pattern = {r"layers\.1\..*": 5.0, "down_proj": 12.0}
    make_adapter(
        AutoModelForCausalLM.from_pretrained(str(llama_dir)),
        tmp_path / "a",
        r=4,
        alpha=8.0,
        rank_pattern=rank_pattern,
        alpha_pattern=alpha_pattern,
    )
    loaded = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(str(llama_dir)), tmp_path / "a")
    lora = parse_adapter(*read_adapter_files(str(tmp_path / "a")))
    ranks, scalings = set(), set()
    for name, module in loaded.base_model.model.named_modules():
        if not hasattr(module, "lora_B") or "default" not in module.lora_B:
            continue
        layer, short = int(name.split(".")[2]), name.rsplit(".", 1)[1]
        b = module.lora_B["default"].weight.detach().numpy()  # [out, r]
        want = b.T * module.scaling["default"]
        got = lora.modules[short][1][layer]
        r = want.shape[0]
        assert r == module.r["default"] and not got[r:].any(), name
        np.testing.assert_allclose(got[:r], want, rtol=1e-6, atol=1e-7, err_msg=name)
        ranks.add(r)
        scalings.add(module.scaling["default"])
    assert ranks == {2, 3, 4, 6} and len(scalings) > 3  # the patterns did vary them
