"""otel_rl._values.coerce_metrics and Handle.log: what a step record holds, and never raising on junk."""

from __future__ import annotations

import logging
import math
import uuid
from fractions import Fraction

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import otel_rl
from otel_rl import _values
from otel_rl._values import coerce_metrics
from otel_rl.testing import CaptureExporter


def same(a, b) -> bool:
    """Equal with the same Python type; NaN equals NaN."""
    if type(a) is not type(b):
        return False
    if type(a) is float and math.isnan(a):
        return math.isnan(b)
    return a == b


# ----------------------------------------------------------------------------- coerce_metrics


def test_python_scalars_kept_exactly():
    data = {"i": 3, "f": 0.25, "b": True, "bf": False, "nan": math.nan, "inf": math.inf, "ninf": -math.inf,
            "neg0": -0.0, "big": 2**62 + 1, "huge": 10**30}
    out, skipped = coerce_metrics(data)
    assert skipped == []
    assert list(out) == list(data)
    for k, v in data.items():
        assert same(out[k], v), k
    assert math.copysign(1.0, out["neg0"]) == -1.0


def test_scalar_subclasses_and_fractions():
    import enum

    class Level(enum.IntEnum):
        HIGH = 7

    out, skipped = coerce_metrics({"enum": Level.HIGH, "frac": Fraction(1, 4)})
    assert skipped == []
    assert same(out["enum"], 7) and same(out["frac"], 0.25)


@pytest.mark.parametrize("value, expected", [
    (np.float64(1.5), 1.5),
    (np.float32(0.1), 0.1),  # the shortest text of the float32, as verl writes it
    (np.float16(2.5), 2.5),
    (np.int64(-(2**62)), -(2**62)),
    (np.int32(7), 7),
    (np.int8(-3), -3),
    (np.uint64(2**63 + 5), 2**63 + 5),
    (np.uint8(255), 255),
    (np.bool_(True), True),
    (np.bool_(False), False),
    (np.float64("nan"), math.nan),
    (np.float32("-inf"), -math.inf),
    (np.array(2.5), 2.5),
    (np.array(4, dtype=np.int64), 4),
    (np.array(True), True),
    (np.array(np.float32(3.0)), 3.0),
])
def test_numpy_scalars_and_0d_arrays(value, expected):
    out, skipped = coerce_metrics({"k": value})
    assert skipped == []
    assert same(out["k"], expected), (out["k"], expected)


@pytest.mark.parametrize("tensor, expected", [
    (torch.tensor(1.5, dtype=torch.float32), 1.5),
    (torch.tensor(0.1, dtype=torch.float32), float(torch.tensor(0.1, dtype=torch.float32).item())),
    (torch.tensor(0.1, dtype=torch.float64), 0.1),
    (torch.tensor(2**62 + 3, dtype=torch.int64), 2**62 + 3),
    (torch.tensor(-5, dtype=torch.int32), -5),
    (torch.tensor(True), True),
    (torch.tensor(False), False),
    (torch.tensor(float("nan")), math.nan),
    (torch.tensor(float("inf"), dtype=torch.float64), math.inf),
    (torch.tensor(1.0, dtype=torch.bfloat16), 1.0),
    (torch.tensor(3.0, requires_grad=True) * 2, 6.0),
    (torch.tensor(2.0, requires_grad=True), 2.0),
])
def test_torch_0d_tensors(tensor, expected):
    out, skipped = coerce_metrics({"t": tensor})
    assert skipped == []
    assert same(out["t"], expected), (out["t"], expected)


def test_many_tensors_in_one_call_keep_values_and_order():
    data: dict = {}
    expected: dict = {}
    for i in range(60):
        kind = i % 6
        key = f"m/{59 - i:02d}"  # keys not in sorted order
        if kind == 0:
            data[key], expected[key] = torch.tensor(i + 0.5, dtype=torch.float32), i + 0.5
        elif kind == 1:
            data[key], expected[key] = torch.tensor(i * 1000003, dtype=torch.int64), i * 1000003
        elif kind == 2:
            data[key], expected[key] = torch.tensor(i % 4 == 2), i % 4 == 2
        elif kind == 3:
            data[key], expected[key] = float(i), float(i)
        elif kind == 4:
            data[key], expected[key] = torch.tensor(i / 7, dtype=torch.float64, requires_grad=True), i / 7
        else:
            data[key], expected[key] = np.int16(i), i
    out, skipped = coerce_metrics(data)
    assert skipped == []
    assert list(out) == list(data)
    for k in data:
        assert same(out[k], expected[k]), (k, out[k], expected[k])


@pytest.mark.parametrize("value", [
    "1.0", b"1", None, [1.0], (1.0,), {"a": 1.0}, {1.0}, np.zeros(3), np.zeros((2, 2)), np.array([1.0]),
    np.array("x"), np.array(None, dtype=object), np.datetime64("2020-01-01"), torch.zeros(2), torch.tensor([1.0]),
    torch.zeros(1, 1), complex(1, 2), object(), print,
])
def test_non_scalars_skipped_and_reported(value):
    out, skipped = coerce_metrics({"good": 1.0, "bad": value, "good2": 2})
    assert out == {"good": 1.0, "good2": 2}
    assert skipped == ["bad"]


class _BrokenShape:
    @property
    def shape(self):
        raise RuntimeError("broken property")


class _BrokenItem:
    shape = ()

    def item(self):
        raise RuntimeError("broken item")


def test_values_whose_conversion_raises_are_skipped():
    data = {"shape": _BrokenShape(), "item": _BrokenItem(), "overflow": Fraction(10**400, 1), "ok": 1}
    out, skipped = coerce_metrics(data)
    assert out == {"ok": 1}
    assert sorted(skipped) == ["item", "overflow", "shape"]


def test_tensor_that_cannot_reach_the_host_is_skipped():
    out, skipped = coerce_metrics({"meta": torch.tensor(1.0, device="meta"), "ok": torch.tensor(2.0)})
    assert skipped == ["meta"]
    assert out == {"ok": 2.0}


def test_non_string_keys_converted():
    out, skipped = coerce_metrics({1: 1.0, 2.5: 2, (3, 4): True, None: 0.5, "s": [1]})
    assert out == {"1": 1.0, "2.5": 2, "(3, 4)": True, "None": 0.5}
    assert all(type(k) is str for k in out)
    assert skipped == ["s"]


@pytest.mark.parametrize("data", [None, 1.0, "loss", [("a", 1.0)], torch.tensor(1.0), np.zeros(2)])
def test_non_mapping_raises_type_error(data):
    with pytest.raises(TypeError, match="mapping"):
        coerce_metrics(data)


def test_mapping_like_objects_accepted():
    from collections import OrderedDict
    from types import MappingProxyType

    assert coerce_metrics(OrderedDict(a=1.0))[0] == {"a": 1.0}
    assert coerce_metrics(MappingProxyType({"b": 2}))[0] == {"b": 2}


# ----------------------------------------------------------------------------- Handle.log via the pipeline


@pytest.fixture
def capture():
    cap = CaptureExporter()
    h = otel_rl.init(exporters=[cap], batch_delay_s=0.05)
    cap.handle = h
    try:
        yield cap, h
    finally:
        h.shutdown()


def _warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "otel_rl" and r.levelno == logging.WARNING]


def test_log_junk_never_raises_and_warns_once_per_key(capture, caplog):
    cap, h = capture
    tag = uuid.uuid4().hex[:8]  # warn-once is per process: use keys no other test used
    bad = {f"{tag}/str": "x", f"{tag}/none": None, f"{tag}/list": [1, 2], f"{tag}/arr": np.ones(3),
           f"{tag}/vec": torch.tensor([1.0]), f"{tag}/dict": {"a": 1}, f"{tag}/shape": _BrokenShape(),
           f"{tag}/meta": torch.tensor(1.0, device="meta")}
    caplog.set_level(logging.WARNING, logger="otel_rl")
    for _ in range(3):
        h.log({**bad, "loss": 0.5, "acc": torch.tensor(0.75)}, step=4)
    h.log(None, step=4)
    h.log("loss", step=4)
    h.log(42, step=4)
    h.log({}, step=4)
    otel_rl.log({f"{tag}/str": "again", "loss2": 1}, step=4)
    cap.collect()
    per_key = {k: sum(1 for m in _warnings(caplog) if repr(k) in m) for k in bad}
    assert per_key == {k: 1 for k in bad}, per_key
    assert cap.metrics_by_step()[4] == {"loss": 0.5, "acc": 0.75, "loss2": 1}
    # three identical calls give three records, all with only the good keys; log({}) is an empty record
    recs = [m for m in cap.step_metrics() if m.step == 4]
    assert [list(m.values) for m in recs] == [["loss", "acc"]] * 3 + [[], ["loss2"]]


def test_log_with_only_bad_values_records_nothing(capture):
    cap, h = capture
    h.log({f"only-bad-{uuid.uuid4().hex}": "text"}, step=1)
    cap.collect()
    assert cap.step_metrics() == []


@pytest.mark.parametrize("bad_step", ["x", "3.0", "", 2.5, float("nan"), float("inf"), [1], object()])
def test_bad_step_falls_back_with_warning(capture, caplog, bad_step):
    cap, h = capture
    _values._warned_keys.discard(f"bad-step:{type(bad_step).__name__}")  # warn-once is per process
    caplog.set_level(logging.WARNING, logger="otel_rl")
    h.log({"a": 1.0}, step=5)
    h.log({"b": 2.0}, step=bad_step)  # falls back to the last step logged
    with otel_rl.step(9):
        h.log({"c": 3.0}, step=bad_step)  # inside a step block: that step
    cap.collect()
    by_step = cap.metrics_by_step()
    assert by_step[5] == {"a": 1.0, "b": 2.0}
    assert by_step[9] == {"c": 3.0}
    msgs = [m for m in _warnings(caplog) if "not an integer" in m]
    assert len(msgs) == 1 and repr(bad_step)[:10] in msgs[0]


def test_integral_steps_accepted(capture):
    cap, h = capture
    h.log({"a": 1}, step=3.0)
    h.log({"b": 2}, step=np.int64(4))
    h.log({"c": 3}, step=torch.tensor(5))
    h.log({"d": 4})  # no step: the last one
    cap.collect()
    assert cap.metrics_by_step() == {3: {"a": 1}, 4: {"b": 2}, 5: {"c": 3, "d": 4}}


def test_log_after_shutdown_is_silent():
    cap = CaptureExporter()
    h = otel_rl.init(exporters=[cap], batch_delay_s=0.05)
    h.shutdown()
    h.log({"a": 1.0}, step=1)  # must not raise
    assert cap.step_metrics() == []


KEYS = st.text(min_size=1, max_size=12)
VALUES = st.one_of(
    st.floats(allow_nan=True, allow_infinity=True),
    st.integers(min_value=-(2**63), max_value=2**63 - 1),
    st.integers(min_value=2**53 + 1, max_value=2**63 - 1),
    st.booleans(),
)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.dictionaries(KEYS, VALUES, min_size=1, max_size=12))
def test_logged_values_read_back_identically(capture, data):
    cap, h = capture
    cap.clear()
    h.log(data, step=7)
    cap.collect()
    recs = cap.step_metrics()
    assert len(recs) == 1
    got = recs[0].values
    assert recs[0].step == 7
    assert list(got) == list(data)  # key order
    for k, v in data.items():
        assert same(got[k], v), (k, v, got[k])
        if type(v) is float and v == 0.0:
            assert math.copysign(1.0, got[k]) == math.copysign(1.0, v)


def test_huge_ints_exact_through_pipeline(capture):
    cap, h = capture
    data = {"a": 2**53 + 1, "b": -(2**63), "c": 2**63 - 1, "d": 2**62 + 12345}
    h.log(data, step=1)
    cap.collect()
    got = cap.metrics_by_step()[1]
    assert got == data and all(type(v) is int for v in got.values())
