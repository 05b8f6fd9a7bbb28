"""otel_rl.serialize.to_json: never raises, valid JSON, readable forms, truncation."""

from __future__ import annotations

import dataclasses
import enum
import json
import math
import re
from pathlib import Path, PurePosixPath

import numpy as np
import pydantic
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from otel_rl.serialize import TRUNCATION_MARK, json_float, json_text, materialize, parse_json_float, snapshot, to_json


def loads(obj, **kw):
    text, truncated = to_json(obj, **kw)
    assert isinstance(text, str)
    assert truncated is False
    return json.loads(text)  # strict: json.loads accepts NaN, so also check below


def strict_loads(text: str):
    def bad(c):
        raise ValueError(f"non-standard JSON constant {c}")

    return json.loads(text, parse_constant=bad)


@dataclasses.dataclass
class Point:
    x: int
    y: float
    tags: list = dataclasses.field(default_factory=list)


@dataclasses.dataclass
class Wrapper:
    point: Point
    arr: object = None


class Msg(pydantic.BaseModel):
    role: str
    content: str
    n: int = 1


class Color(enum.Enum):
    RED = "red"
    BLUE = 2


class BadRepr:
    def __repr__(self):
        raise RuntimeError("no repr for you")


class BadEverything:
    def __repr__(self):
        raise RuntimeError("repr")

    def __getattr__(self, name):
        raise RuntimeError(f"getattr {name}")


def test_dataclass_nested():
    assert loads(Wrapper(Point(1, 2.5, ["a"]), np.arange(3))) == {"point": {"x": 1, "y": 2.5, "tags": ["a"]},
                                                                 "arr": [0, 1, 2]}


def test_dataclass_with_nan_goes_through_slow_path():
    text, truncated = to_json(Point(1, math.nan))
    assert not truncated
    assert strict_loads(text) == {"x": 1, "y": "NaN", "tags": []}


def test_pydantic_model():
    assert loads(Msg(role="user", content="hi")) == {"role": "user", "content": "hi", "n": 1}
    assert loads({"msgs": [Msg(role="a", content="b", n=2)]}) == {"msgs": [{"role": "a", "content": "b", "n": 2}]}


def test_pydantic_model_class_is_not_dumped():
    out = loads(Msg)
    assert isinstance(out, str) and "Msg" in out


@pytest.mark.parametrize("value, expected", [
    (np.float32(0.5), 0.5), (np.float64(1.25), 1.25), (np.int64(2**62), 2**62), (np.int8(-4), -4),
    (np.uint16(9), 9), (np.bool_(True), True), (np.array(3.5), 3.5), (np.arange(4), [0, 1, 2, 3]),
    (np.array([[1.5, 2.0], [3.0, 4.0]], dtype=np.float32), [[1.5, 2.0], [3.0, 4.0]]),
    (np.array(["a", "b"]), ["a", "b"]), (np.array([True, False]), [True, False]),
])
def test_numpy(value, expected):
    assert loads(value) == expected


def test_numpy_large_array_summarised():
    arr = np.arange(5000, dtype=np.int32).reshape(50, 100)
    out = loads(arr)
    assert out["ndarray"] == {"shape": [50, 100], "dtype": "int32"}
    assert out["head"] == list(range(1000))


def test_numpy_with_nan():
    text, _ = to_json(np.array([1.0, np.nan, np.inf, -np.inf]))
    assert strict_loads(text) == [1.0, "NaN", "Infinity", "-Infinity"]
    text, _ = to_json(np.float32("nan"))
    assert strict_loads(text) == "NaN"


@pytest.mark.parametrize("value, expected", [
    (torch.tensor(1.5), 1.5), (torch.tensor(7), 7), (torch.tensor(True), True),
    (torch.tensor([1, 2, 3]), [1, 2, 3]), (torch.tensor([[0.5, 1.0]], dtype=torch.float64), [[0.5, 1.0]]),
    (torch.tensor([1.0, 2.0], requires_grad=True), [1.0, 2.0]), (torch.tensor([1.0], dtype=torch.bfloat16), [1.0]),
    (torch.zeros(0), []),
])
def test_torch_small(value, expected):
    assert loads(value) == expected


def test_torch_large_summarised():
    t = torch.arange(3000, dtype=torch.int64).reshape(3, 1000)
    out = loads({"ids": t})["ids"]
    assert out["tensor"] == {"shape": [3, 1000], "dtype": "torch.int64", "device": "cpu"}
    assert out["head"] == list(range(1000))


def test_torch_with_nan():
    text, _ = to_json({"t": torch.tensor([float("nan"), 1.0])})
    assert strict_loads(text) == {"t": ["NaN", 1.0]}


def test_bytes():
    assert loads(b"hello \xc3\xa9") == "hello \u00e9"
    assert loads(bytearray(b"abc")) == "abc"
    assert loads(memoryview(b"xyz")) == "xyz"
    binary = loads(b"\xff\xfe\x00\x01")
    assert binary == repr(b"\xff\xfe\x00\x01")
    big = loads(b"\xff" * 10000)
    assert isinstance(big, str) and len(big) < 20000


def test_sets_enums_paths():
    assert sorted(loads({1, 2, 3})) == [1, 2, 3]
    assert sorted(loads(frozenset({"a", "b"}))) == ["a", "b"]
    assert loads(Color.RED) == "red" and loads(Color.BLUE) == 2
    assert loads(Path("/tmp/x.txt")) == "/tmp/x.txt"
    assert loads(PurePosixPath("a/b")) == "a/b"
    assert loads({"p": [Path("/a"), {Color.RED}]}) == {"p": ["/a", ["red"]]}


def test_non_string_keys():
    assert loads({1: "a", 2.5: "b", None: "c", False: "d"}) == {"1": "a", "2.5": "b", "null": "c", "false": "d"}
    out = loads({(1, 2): "tuple key", Color.RED: 1})
    assert out == {"(1, 2)": "tuple key", str(Color.RED): 1}


def test_cycles():
    d: dict = {"a": 1}
    d["self"] = d
    assert loads(d) == {"a": 1, "self": "<cycle>"}
    lst: list = [1]
    lst.append(lst)
    assert loads(lst) == [1, "<cycle>"]
    a: dict = {}
    b: dict = {"a": a}
    a["b"] = b
    assert loads({"root": a}) == {"root": {"b": {"a": "<cycle>"}}}


def test_shared_reference_is_not_a_cycle():
    shared = {"v": 1}
    assert loads({"x": shared, "y": shared, "z": [shared, float("nan")]}) == {
        "x": {"v": 1}, "y": {"v": 1}, "z": [{"v": 1}, "NaN"]}


def test_dataclass_cycle():
    p = Point(1, 2.0)
    p.tags.append(p)
    out = loads(p)
    assert out["x"] == 1 and out["tags"] == ["<cycle>"]



@pytest.mark.parametrize("limit", [None, 3000, 50000])
def test_cycles_under_any_recursion_limit_and_a_small_thread_stack(limit, monkeypatch):
    """Cycles are found whether the fast encoder runs into the recursion limit (default and raised up to
    its bound) or, above that bound, the encoder that tracks containers does; in a thread whose stack is
    512 KiB, so that running into the limit must not overflow the C stack either."""
    import sys
    import threading

    import otel_rl.serialize as ser

    monkeypatch.setattr(ser, "_careful", 0)  # the fast encoder first, whatever an earlier test left
    results: list = []

    def run():
        old = sys.getrecursionlimit()
        if limit is not None:
            sys.setrecursionlimit(limit)
        try:
            p = Point(1, 2.0)
            p.tags.append(p)
            d: dict = {"a": 1}
            d["self"] = d
            results.append((loads(p), loads(d), loads({"deep": [[[[{"ok": 1}]]]]})))
        finally:
            sys.setrecursionlimit(old)

    previous = threading.stack_size(512 * 1024)
    try:
        t = threading.Thread(target=run)
        t.start()
        t.join()
    finally:
        threading.stack_size(previous)
    assert results, "the thread died"
    point, d, deep = results[0]
    assert point["x"] == 1 and point["tags"] == ["<cycle>"]
    assert d == {"a": 1, "self": "<cycle>"}
    assert deep == {"deep": [[[[{"ok": 1}]]]]}


def test_after_a_cycle_the_encoder_with_the_map_is_used_for_a_while_with_the_same_results(monkeypatch):
    """A cycle found by running into the recursion limit switches to the encoder that tracks containers for
    the next calls (cycles in one program tend to come back; running into the limit each time costs ~0.5
    ms); both encoders give the same text for the same values."""
    import otel_rl.serialize as ser

    monkeypatch.setattr(ser, "_careful", 0)
    p = Point(1, 2.0)
    p.tags.append(p)
    values = [{"a": [1, 2.5, None, True], "b": {"c": "d"}}, Point(3, 4.0), [float("nan")], "text", 7]
    fast = [to_json(v) for v in values]
    assert ser._careful == 0  # no cycle yet: the fast encoder all along
    assert loads(p)["tags"] == ["<cycle>"]
    assert ser._careful == ser._CAREFUL_CALLS
    careful = [to_json(v) for v in values]
    assert careful == fast
    assert ser._careful == ser._CAREFUL_CALLS - (len(values) - 1)  # every call but the str one counted down
    assert loads(p)["tags"] == ["<cycle>"]  # found by the map this time: still marked
    monkeypatch.setattr(ser, "_careful", 1)
    to_json([1])
    assert ser._careful == 0 and to_json(values[0]) == fast[0]

def test_broken_repr_never_raises():
    out = loads(BadRepr())
    assert isinstance(out, str) and "BadRepr" in out
    out = loads({"k": [BadEverything(), 1]})
    assert out["k"][1] == 1 and "BadEverything" in out["k"][0]


def test_plain_object_uses_repr():
    class Thing:
        def __repr__(self):
            return "Thing(42)"

    assert loads({"t": Thing()}) == {"t": "Thing(42)"}
    assert isinstance(loads(object()), str)
    assert isinstance(loads(lambda x: x), str)


@pytest.mark.parametrize("value, expected", [
    (math.nan, "NaN"), (math.inf, "Infinity"), (-math.inf, "-Infinity"),
    ([1.0, math.nan], [1.0, "NaN"]), ({"a": {"b": -math.inf}}, {"a": {"b": "-Infinity"}}),
    ((math.inf,), ["Infinity"]),
])
def test_non_finite_floats(value, expected):
    text, truncated = to_json(value)
    assert not truncated
    assert strict_loads(text) == expected


def test_deep_nesting():
    deep: object = "leaf"
    for _ in range(5000):
        deep = [deep]
    text, truncated = to_json(deep)
    assert not truncated
    out = strict_loads(text)
    depth = 0
    while isinstance(out, list):
        out = out[0]
        depth += 1
    assert out == "<max depth>" and 10 < depth < 5000

    deep_d: object = math.nan
    for i in range(3000):
        deep_d = {f"k{i}": deep_d}
    strict_loads(to_json(deep_d)[0])


def test_moderate_nesting_is_exact():
    v: object = 1
    for _ in range(200):
        v = [v]
    assert loads(v) == v


def test_big_container_with_nan_is_capped_per_container():
    out = loads([math.nan] * 1500)
    assert len(out) == 1001 and out[0] == "NaN" and "500 more" in out[-1]


@pytest.mark.parametrize("max_chars", [1, 10, 100, 1000])
def test_truncation(max_chars):
    value = {"text": "x" * 5000, "n": list(range(500))}
    full, truncated = to_json(value)
    assert not truncated
    text, truncated = to_json(value, max_chars=max_chars)
    assert truncated is True
    m = re.search(r"\.\.\.\[truncated (\d+) chars\]$", text)
    assert m, text[-60:]
    assert int(m.group(1)) == len(full) - max_chars
    assert text.startswith(full[:max_chars])
    assert len(text) == max_chars + len(TRUNCATION_MARK.format(m.group(1)))


def test_no_truncation_at_exact_size():
    full, _ = to_json("abcdef")
    text, truncated = to_json("abcdef", max_chars=len(full))
    assert (text, truncated) == (full, False)
    text, truncated = to_json("abcdef", max_chars=len(full) - 1)
    assert truncated and text.endswith("[truncated 1 chars]")


def test_unicode_kept_readable():
    text, _ = to_json({"msg": "héllo 世界 🙂"})
    assert "世界" in text and json.loads(text) == {"msg": "héllo 世界 🙂"}


JSON_SCALARS = st.one_of(
    st.none(), st.booleans(), st.integers(), st.floats(allow_nan=False, allow_infinity=False), st.text(max_size=20),
)
JSON_VALUES = st.recursive(
    JSON_SCALARS,
    lambda children: st.one_of(st.lists(children, max_size=6), st.dictionaries(st.text(max_size=10), children, max_size=6)),
    max_leaves=40,
)


@settings(max_examples=300, deadline=None)
@given(JSON_VALUES)
def test_json_like_values_round_trip(value):
    text, truncated = to_json(value)
    assert not truncated
    assert strict_loads(text) == value


NONFINITE_JSON = st.recursive(
    st.one_of(JSON_SCALARS, st.floats()),
    lambda children: st.one_of(st.lists(children, max_size=6), st.dictionaries(st.text(max_size=10), children, max_size=6)),
    max_leaves=40,
)


def _expected_with_strings(v):
    if isinstance(v, float) and not math.isfinite(v):
        return json_float(v)
    if isinstance(v, list):
        return [_expected_with_strings(x) for x in v]
    if isinstance(v, dict):
        return {k: _expected_with_strings(x) for k, x in v.items()}
    return v


@settings(max_examples=200, deadline=None)
@given(NONFINITE_JSON)
def test_values_with_non_finite_floats_are_strict_json(value):
    text, truncated = to_json(value)
    assert not truncated
    assert strict_loads(text) == _expected_with_strings(value)


@settings(max_examples=100, deadline=None)
@given(JSON_VALUES, st.integers(min_value=0, max_value=200))
def test_truncated_text_is_a_prefix_plus_marker(value, max_chars):
    full, _ = to_json(value)
    text, truncated = to_json(value, max_chars=max_chars)
    assert truncated == (len(full) > max_chars)
    if truncated:
        assert text == full[:max_chars] + TRUNCATION_MARK.format(len(full) - max_chars)
    else:
        assert text == full


@settings(max_examples=300, deadline=None)
@given(st.one_of(st.floats(), st.integers(), st.booleans()))
def test_json_float_round_trip(value):
    encoded = json_float(value)
    assert type(encoded) in (float, int, bool, str)
    if type(value) is float and not math.isfinite(value):
        assert encoded in ("NaN", "Infinity", "-Infinity")
    else:
        assert encoded is value
    back = parse_json_float(strict_loads(json.dumps(encoded, allow_nan=False)))
    if type(value) is float and math.isnan(value):
        assert type(back) is float and math.isnan(back)
    else:
        assert back == value and type(back) is type(value)


def test_parse_json_float_leaves_other_values():
    assert parse_json_float("nan") == "nan"
    assert parse_json_float("x") == "x"
    assert parse_json_float(None) is None
    assert parse_json_float(3) == 3


# ----------------------------------------------------------------------------- deferred JSON (snapshot)

SNAPSHOT_CORPUS = [
    {"prompt_ids": [3, 14, 5], "sampling_params": {"temperature": 1.0, "max_tokens": 4}},
    {1: "int key", (1, 2): "tuple key", None: 0, 2.5: True},
    [float("nan"), float("inf"), -float("inf"), -0.0, 1e308, 5e-324],
    {"b": b"\x00abc", "bad": b"\xff\xfe", "ba": bytearray(b"x")},
    {"s": {3, 1, 2}, "f": frozenset({"a"}), "t": ()},
    ["ctrl \x01\x1f", "unicode é 漢字 \u2028", "", "q\"uote\\"],
    [10**30, -(2**63), True, False, None, 0],
    [], {}, "plain", 7, 2.5, None, b"",
    [[[[[1]]]]], {"a": {"b": {"c": [{"d": None}]}}},
]


@pytest.mark.parametrize("value", SNAPSHOT_CORPUS, ids=range(len(SNAPSHOT_CORPUS)))
def test_a_snapshot_reads_as_the_json_of_the_value_it_copied(value):
    copy, truncated = snapshot(value)
    assert truncated is False
    assert type(copy) is bytes  # builtin data only: copied, not encoded
    assert json_text(copy) == to_json(value)


@settings(max_examples=300, deadline=None)
@given(st.recursive(st.none() | st.booleans() | st.integers() | st.floats() | st.text() | st.binary(),
                    lambda c: st.lists(c) | st.dictionaries(st.text() | st.integers(), c) | st.tuples(c, c),
                    max_leaves=30))
def test_snapshot_then_json_text_is_to_json(value):
    copy, truncated = snapshot(value)
    if type(copy) is bytes:  # plain data: copied, its text made later
        assert truncated is False and json_text(copy) == to_json(value)
    else:  # encoded at once (too large for a copy)
        assert (copy, truncated) == to_json(value)


def test_a_snapshot_is_a_copy_taken_when_it_is_made():
    prompt = [1, 2, 3]
    params = {"t": 1.0}
    copy, _ = snapshot({"prompt_ids": prompt, "params": params})
    prompt += [4, 5]
    params["t"] = 0.0
    assert json.loads(json_text(copy)[0]) == {"prompt_ids": [1, 2, 3], "params": {"t": 1.0}}


class Colour(str, enum.Enum):
    RED = "red"


@pytest.mark.parametrize("value", [Point(1, 2.0), torch.tensor([1.0, 2.0]), np.arange(3), np.float64(0.5),
                                   [np.int64(3)], Colour.RED, {"k": Colour.RED}, [Point(0, 0.5)], Path("/x"),
                                   memoryview(b"mv"), 1 + 2j, ..., object()],
                         ids=["dataclass", "tensor", "ndarray", "np-scalar", "np-int-in-list", "str-enum",
                              "enum-in-dict", "nested", "path", "memoryview", "complex", "ellipsis", "object"])
def test_values_that_are_not_plain_data_are_encoded_at_once(value):
    """Not copied as data: a buffer (numpy, memoryview) would come back as bytes, a subclass as its base."""
    text, truncated = snapshot(value)
    assert type(text) is str
    assert (text, truncated) == to_json(value)


def test_a_value_holding_itself_reads_as_to_json_and_a_large_one_is_encoded_at_once():
    cyc: list = [1, {"k": "v"}]
    cyc.append(cyc)
    cyc.append(cyc[1])  # shared, not a cycle
    copy, truncated = snapshot(cyc)
    assert json_text(copy) == to_json(cyc) and "<cycle>" in to_json(cyc)[0]
    big = list(range(5000))
    text, truncated = snapshot(big, max_chars=1000)
    assert type(text) is str and truncated and (text, truncated) == to_json(big, 1000)


def test_materialize_turns_copies_into_text_and_marks_a_cut():
    attrs = {"rl.op.inputs": snapshot({"ids": list(range(300))})[0], "rl.op.output": snapshot("done")[0],
             "other": b"left alone"}
    assert all(type(attrs[k]) is bytes for k in ("rl.op.inputs", "rl.op.output"))
    out = materialize(attrs, max_chars=100)
    assert out is attrs
    assert attrs["rl.op.inputs"] == to_json({"ids": list(range(300))}, 100)[0]
    assert attrs["rl.op.output"] == '"done"' and attrs["rl.truncated"] is True
    assert attrs["other"] == b"left alone"  # only the op's inputs and output are deferred
    assert materialize(attrs, 100) == attrs  # again: nothing left to do
    plain = {"rl.op.inputs": '{"a": 1}'}
    assert materialize(dict(plain)) == plain and "rl.truncated" not in materialize(dict(plain))


def test_after_a_stopped_copy_the_next_one_is_whole():
    """The per-thread pickler is reused: a copy stopped half-way (not plain data deep inside, a cycle,
    a value nested too deep) leaves nothing behind for the next one."""
    deep: list = []
    node = deep
    for _ in range(5000):
        node.append([])
        node = node[0]
    cyc: dict = {"a": [1, 2]}
    cyc["self"] = cyc
    for bad in ({"x": [1, 2, {"y": np.float64(1.0)}]}, cyc, deep, [Point(1, 1.0)] * 3):
        text, _ = snapshot(bad)
        assert type(text) is str and (text, _) == to_json(bad)
        good = {"ids": [1, 2, 3], "s": "ok", "f": 0.5}
        copy, truncated = snapshot(good)
        assert type(copy) is bytes and json_text(copy) == to_json(good)


def test_copies_made_in_many_threads_at_once_are_their_own():
    import threading

    errors = []

    def work(k):
        try:
            for i in range(2000):
                v = {"thread": k, "i": i, "ids": list(range(i % 17))}
                copy, _ = snapshot(v)
                if json_text(copy) != to_json(v):
                    errors.append((k, i))
        except Exception as exc:  # pragma: no cover - reported below
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []


def test_a_copy_asked_for_while_one_is_being_made_on_the_same_thread_is_encoded():
    """Code that runs in the middle of a copy on the same thread (a finalizer run by the collector, a
    signal handler) and traces an op gets its JSON at once rather than the busy pickler; the next copy
    is whole again."""
    from otel_rl import serialize as ser

    snapshot(1)  # this thread's pickler exists
    p = ser._local.p
    p.busy = True  # as while its dump() runs
    try:
        assert snapshot({"a": [1]}) == to_json({"a": [1]})
        assert p.chunks == []
    finally:
        p.busy = False
    copy, _ = snapshot({"a": [1]})
    assert type(copy) is bytes and json_text(copy) == to_json({"a": [1]})
