"""Core exporters against verl's formats, delivery failure handling, exporter lookup.

verl facts (checked in the verl 0.9.1 wheel):

- console (``verl/utils/logger/aggregate_logger.py``, ``concat_dict_to_str``):
  ``"step:{step}"`` then ``f"{k}:{pprint.pformat(v)}"`` for every value that is a
  ``numbers.Number``, joined with ``" - "``, printed once per ``log()`` call.
  (verl <= 0.3 printed ``{v:.3f}``; 0.5+ prints full precision.)
- file (``verl/utils/tracking.py``, ``FileLogger``): per ``log()`` call
  ``orjson.dumps({"step": step, "data": data}, option=orjson.OPT_SERIALIZE_NUMPY) + b"\\n"``
  to ``$VERL_FILE_LOGGER_PATH`` or ``$VERL_FILE_LOGGER_ROOT/<project>/<experiment>.jsonl``
  (root default ``"."``).

Documented deviations tested here: NaN/+-Inf are written as the strings "NaN",
"Infinity", "-Infinity" (verl/orjson write ``null``); ints beyond 64 bits are
written exactly (orjson, so verl, raises).
"""

from __future__ import annotations

import glob
import importlib.util
import io
import json
import logging
import math
import os
import threading
import time
import uuid
import zipfile

import orjson
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import otel_rl
from otel_rl.exporters import jsonl as jsonl_mod
from otel_rl.exporters import registry
from otel_rl.exporters.console import ConsoleExporter, format_line
from otel_rl.records import RunStart, StepMetrics
from otel_rl.testing import CaptureExporter

# ----------------------------------------------------------------------------- helpers


@pytest.fixture(autouse=True)
def _isolated(monkeypatch, tmp_path):
    """No OTEL_*/verl env leaking in, cwd in a temp dir, no pipeline left running."""
    for k in list(os.environ):
        if k.startswith(("OTEL_", "VERL_FILE_LOGGER")):
            monkeypatch.delenv(k, raising=False)
    monkeypatch.chdir(tmp_path)
    yield
    h = otel_rl.current()
    if h is not None:
        h.shutdown(5)


def _init(exporters, **kw):
    kw.setdefault("project", "p")
    kw.setdefault("experiment", "e")
    kw.setdefault("batch_delay_s", 0.05)
    return otel_rl.init(exporters=exporters, **kw)


def _verl_console(data: dict, step: int) -> str:
    """verl's console line, computed independently: repr is pprint.pformat for these scalars."""
    return " - ".join([f"step:{step}"] + [f"{k}:{v!r}" for k, v in data.items()])


def _verl_file(data: dict, step: int) -> bytes:
    return orjson.dumps({"step": step, "data": data}, option=orjson.OPT_SERIALIZE_NUMPY) + b"\n"


def _strict_loads(line: bytes | str):
    def _reject(name):
        raise ValueError(f"non-standard JSON constant {name}")

    return json.loads(line, parse_constant=_reject)


def _wait_for(pred, timeout_s: float = 10.0, interval: float = 0.01) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if pred():
            return True
        time.sleep(interval)
    return pred()


# keys: unicode, slashes, '@', verl-style names
_KEY = st.one_of(
    # keys verl prints as they are: control characters (and U+2028/2029) are escaped on otel-rl's console
    # (test_log_like_verl.py), so that one log() call stays one line
    st.text(st.characters(codec="utf-8", blacklist_categories=("Cc", "Zl", "Zp")), min_size=1, max_size=20),
    st.sampled_from(["actor/pg_loss", "critic/vf_loss", "timing_s/gen", "val-core/gsm8k/reward/mean@4",
                     "perf/throughput", "réponse/長さ", "a@b/c d", "emoji/🙂"]),
)
_VALUE = st.one_of(
    st.floats(allow_nan=False, allow_infinity=False),
    st.floats(min_value=-1e-3, max_value=1e-3, allow_nan=False),  # orjson's 0.00001 / 1e-6 texts
    st.integers(min_value=-(2**63), max_value=2**64 - 1),  # orjson's range (verl raises beyond)
    st.booleans(),
)
_DATA = st.dictionaries(_KEY, _VALUE, min_size=1, max_size=8)
_CALLS = st.lists(st.tuples(st.integers(min_value=0, max_value=5), _DATA), min_size=1, max_size=6)


# ----------------------------------------------------------------------------- console / jsonl formats


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(calls=_CALLS)
def test_console_and_jsonl_bytes_match_verl(calls, tmp_path_factory):
    path = tmp_path_factory.mktemp("jsonl") / "out.jsonl"
    out = io.StringIO()
    h = _init([ConsoleExporter(stream=out), "jsonl"], jsonl_path=str(path))
    try:
        for step, data in calls:
            otel_rl.log(dict(data), step=step)
        assert h.flush(30)
    finally:
        h.shutdown()
    # one line per log() call, in call order (repeated steps are separate lines)
    assert out.getvalue() == "".join(_verl_console(d, s) + "\n" for s, d in calls)
    assert path.read_bytes() == b"".join(_verl_file(d, s) for s, d in calls)


@settings(max_examples=300, deadline=None)
@given(step=st.integers(min_value=0, max_value=2**31), data=_DATA)
def test_jsonl_encoder_without_orjson_writes_the_same_bytes(step, data):
    # the pure-python path (orjson not installed) must produce orjson's text too
    saved = jsonl_mod._orjson
    jsonl_mod._orjson = None
    try:
        ours = jsonl_mod.encode_line(step, data)
    finally:
        jsonl_mod._orjson = saved
    assert ours == _verl_file(data, step)
    assert jsonl_mod.encode_line(step, data) == ours


@pytest.mark.parametrize("value, text", [
    (1e-6, b"1e-6"), (2.5e-05, b"0.000025"), (1e-05, b"0.00001"), (1e16, b"1e+16"),
    (1e15, b"1000000000000000.0"), (-0.0, b"-0.0"), (0.1, b"0.1"), (3, b"3"), (True, b"true"),
])
def test_jsonl_float_text_is_orjsons(value, text, monkeypatch):
    for impl in (jsonl_mod._orjson, None):
        monkeypatch.setattr(jsonl_mod, "_orjson", impl)
        assert jsonl_mod.encode_line(7, {"lr": value}) == b'{"step":7,"data":{"lr":' + text + b"}}\n"


def test_console_by_name_prints_verl_lines_to_stdout(capsys):
    h = _init(["console"])
    try:
        otel_rl.log({"actor/pg_loss": 0.123456789, "n": 3, "ok": True}, step=1)
        otel_rl.log({"actor/pg_loss": -2.0, "lr": 1e-6}, step=1)
        otel_rl.log({"x": 1.5}, step=2)
        assert h.flush(10)
    finally:
        h.shutdown()
    assert capsys.readouterr().out == (
        "step:1 - actor/pg_loss:0.123456789 - n:3 - ok:True\n"
        "step:1 - actor/pg_loss:-2.0 - lr:1e-06\n"
        "step:2 - x:1.5\n"
    )


def test_numpy_and_torch_scalars_print_as_plain_numbers(tmp_path):
    np = pytest.importorskip("numpy")
    torch = pytest.importorskip("torch")
    out = io.StringIO()
    path = tmp_path / "m.jsonl"
    h = _init([ConsoleExporter(stream=out), "file"], jsonl_path=str(path))
    try:
        otel_rl.log({"np": np.float64(0.5), "np32": np.float32(0.25), "i": np.int64(7), "t": torch.tensor(2.5)},
                    step=3)
        assert h.flush(10)
    finally:
        h.shutdown()
    assert out.getvalue() == "step:3 - np:0.5 - np32:0.25 - i:7 - t:2.5\n"
    assert path.read_bytes() == b'{"step":3,"data":{"np":0.5,"np32":0.25,"i":7,"t":2.5}}\n'


def test_non_finite_values_deviation_is_strict_json(tmp_path):
    path = tmp_path / "nf.jsonl"
    out = io.StringIO()
    data = {"a": float("nan"), "b": float("inf"), "c": float("-inf"), "d": 1.0}
    h = _init([ConsoleExporter(stream=out), "jsonl"], jsonl_path=str(path))
    try:
        otel_rl.log(data, step=4)
        assert h.flush(10)
    finally:
        h.shutdown()
    raw = path.read_bytes()
    # our deviation: strings, so which non-finite value it was survives
    assert raw == b'{"step":4,"data":{"a":"NaN","b":"Infinity","c":"-Infinity","d":1.0}}\n'
    # verl (orjson) writes null for all three
    assert _verl_file(data, 4) == b'{"step":4,"data":{"a":null,"b":null,"c":null,"d":1.0}}\n'
    parsed = _strict_loads(raw)  # no NaN/Infinity literals
    from otel_rl.serialize import parse_json_float

    back = {k: parse_json_float(v) for k, v in parsed["data"].items()}
    assert math.isnan(back["a"]) and back["b"] == math.inf and back["c"] == -math.inf and back["d"] == 1.0
    # the console prints them the way verl does
    assert out.getvalue() == "step:4 - a:nan - b:inf - c:-inf - d:1.0\n"


def test_int_beyond_64_bits_written_exactly(tmp_path):
    path = tmp_path / "big.jsonl"
    big = 2**70 + 1
    with pytest.raises(TypeError):  # verl's file logger would crash here
        _verl_file({"n": big}, 0)
    h = _init(["jsonl"], jsonl_path=str(path))
    try:
        otel_rl.log({"n": big, "m": 1e-6}, step=0)
        assert h.flush(10)
    finally:
        h.shutdown()
    assert path.read_bytes() == b'{"step":0,"data":{"n":' + str(big).encode() + b',"m":1e-6}}\n'
    assert _strict_loads(path.read_bytes())["data"]["n"] == big


def test_lone_surrogate_key_still_written_as_valid_utf8(tmp_path):
    path = tmp_path / "sur.jsonl"
    key = "bad\ud800key"
    h = _init(["jsonl"], jsonl_path=str(path))
    try:
        otel_rl.log({key: 1.0}, step=0)
        otel_rl.log({"ok": 2.0}, step=1)  # not stuck behind a batch that can never be written
        assert h.flush(10)
    finally:
        h.shutdown()
    raw = path.read_bytes()
    raw.decode("utf-8")  # strict
    lines = [_strict_loads(ln) for ln in raw.splitlines()]
    # the lone surrogate becomes U+FFFD (documented in otel_rl.exporters.jsonl)
    assert lines == [{"step": 0, "data": {"bad\ufffdkey": 1.0}}, {"step": 1, "data": {"ok": 2.0}}]


def test_jsonl_path_precedence(monkeypatch, tmp_path):
    arg = tmp_path / "arg" / "x.jsonl"
    envpath = tmp_path / "env" / "y.jsonl"
    root = tmp_path / "root"

    def run(**kw):
        h = _init(["jsonl"], project="proj", experiment="exp", **kw)
        try:
            otel_rl.log({"v": 1.0}, step=1)
            assert h.flush(10)
        finally:
            h.shutdown()

    monkeypatch.setenv("VERL_FILE_LOGGER_PATH", str(envpath))
    monkeypatch.setenv("VERL_FILE_LOGGER_ROOT", str(root))
    run(jsonl_path=str(arg))  # the argument wins over both variables
    assert arg.read_bytes() == b'{"step":1,"data":{"v":1.0}}\n'
    assert not envpath.exists() and not root.exists()

    run()  # then VERL_FILE_LOGGER_PATH, over the root
    assert envpath.read_bytes() == b'{"step":1,"data":{"v":1.0}}\n'
    assert not root.exists()

    monkeypatch.delenv("VERL_FILE_LOGGER_PATH")
    run()  # then $VERL_FILE_LOGGER_ROOT/<project>/<experiment>.jsonl
    assert (root / "proj" / "exp.jsonl").read_bytes() == b'{"step":1,"data":{"v":1.0}}\n'

    monkeypatch.delenv("VERL_FILE_LOGGER_ROOT")
    run()  # root default "." (the cwd is tmp_path)
    assert (tmp_path / "proj" / "exp.jsonl").read_bytes() == b'{"step":1,"data":{"v":1.0}}\n'


def test_otel_rl_jsonl_path_env_is_the_argument_form(monkeypatch, tmp_path):
    ours = tmp_path / "ours.jsonl"
    monkeypatch.setenv("OTEL_RL_JSONL_PATH", str(ours))
    monkeypatch.setenv("VERL_FILE_LOGGER_PATH", str(tmp_path / "verl.jsonl"))
    h = _init(["file"])
    try:
        otel_rl.log({"v": 2}, step=0)
        assert h.flush(10)
    finally:
        h.shutdown()
    assert ours.read_bytes() == b'{"step":0,"data":{"v":2}}\n'
    assert not (tmp_path / "verl.jsonl").exists()


def test_several_log_calls_per_step_one_line_each_in_order(tmp_path):
    path = tmp_path / "s.jsonl"
    out = io.StringIO()
    calls = [(1, {"a": 1.0}), (1, {"b": 2}), (1, {"a": 3.5}), (2, {"a": 4.0}), (1, {"late": True})]
    h = _init([ConsoleExporter(stream=out), "jsonl"], jsonl_path=str(path))
    try:
        for s, d in calls:
            otel_rl.log(d, step=s)
        assert h.flush(10)
    finally:
        h.shutdown()
    lines = path.read_bytes().splitlines(keepends=True)
    assert lines == [_verl_file(d, s) for s, d in calls]
    assert out.getvalue().splitlines() == [_verl_console(d, s) for s, d in calls]


# ----------------------------------------------------------------------------- against verl's own code


def _verl_wheel() -> str | None:
    cands = [os.environ.get("OTEL_RL_VERL_WHEEL", "")] + sorted(glob.glob("/tmp/verlwheel/verl-*.whl"))
    return next((c for c in cands if c and os.path.isfile(c)), None)


def _verl_files():
    """Reads a file of verl's source: from a verl wheel when one is at hand, else from the installed verl
    package (scripts/bootstrap.sh --test installs verl 0.9.1 without its dependencies); None without both."""
    wheel = _verl_wheel()
    if wheel is not None:
        def read(member: str) -> bytes:
            with zipfile.ZipFile(wheel) as z:
                return z.read(member)
        return read
    spec = importlib.util.find_spec("verl")  # finds the package without importing it
    if spec is None or not spec.submodule_search_locations:
        return None
    root = os.path.dirname(list(spec.submodule_search_locations)[0])

    def read_installed(member: str) -> bytes:
        with open(os.path.join(root, member), "rb") as f:
            return f.read()
    return read_installed


def _load_from_verl(read, member: str, dest, name: str):
    """verl's module `member` loaded on its own (not through the verl package, which otel-rl may patch)."""
    target = dest / os.path.basename(member)
    target.write_bytes(read(member))
    spec = importlib.util.spec_from_file_location(name, target)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_matches_verls_own_loggers(tmp_path, monkeypatch, capsys):
    """verl's own code side by side with ours: from a verl wheel (OTEL_RL_VERL_WHEEL or /tmp/verlwheel/) or
    the installed verl package."""
    read = _verl_files()
    if read is None:
        pytest.skip("no verl: neither installed nor a wheel (pip download verl==0.9.1 --no-deps -d /tmp/verlwheel)")
    pytest.importorskip("torch")  # aggregate_logger imports it
    pytest.importorskip("packaging")  # tracking imports it
    agg = _load_from_verl(read, "verl/utils/logger/aggregate_logger.py", tmp_path, "_verl_aggregate_logger")
    trk = _load_from_verl(read, "verl/utils/tracking.py", tmp_path, "_verl_tracking")

    calls = [
        (0, {"actor/pg_loss": 0.123456789, "actor/lr": 1e-6, "n": 3, "flag": True}),
        (0, {"critic/vf_loss": 2.5e-05, "big": 2**63, "neg": -1.5e300}),
        (1, {"val-core/gsm8k/reward/mean@4": 0.75, "réponse/長さ": 12, "tiny": 5e-324, "zero": -0.0}),
        (7, {"timing_s/gen": 12.000000001, "ints": -(2**63)}),
    ]
    verl_path = tmp_path / "verl.jsonl"
    monkeypatch.setenv("VERL_FILE_LOGGER_PATH", str(verl_path))
    verl_file = trk.FileLogger("p", "e")
    verl_console = agg.LocalLogger(print_to_console=True)
    capsys.readouterr()
    for s, d in calls:
        verl_file.log(d, s)
        verl_console.log(d, s)
    verl_file.finish()
    verl_out = capsys.readouterr().out
    monkeypatch.delenv("VERL_FILE_LOGGER_PATH")

    ours_path = tmp_path / "ours.jsonl"
    out = io.StringIO()
    h = _init([ConsoleExporter(stream=out), "jsonl"], jsonl_path=str(ours_path))
    try:
        for s, d in calls:
            otel_rl.log(d, step=s)
        assert h.flush(10)
    finally:
        h.shutdown()
    assert ours_path.read_bytes() == verl_path.read_bytes()
    assert out.getvalue() == verl_out

    # and the formatting functions on many dicts
    @settings(max_examples=200, deadline=None)
    @given(step=st.integers(min_value=0, max_value=10**6), data=_DATA)
    def check(step, data):
        assert format_line(data, step) == agg.concat_dict_to_str(data, step)

    check()


# ----------------------------------------------------------------------------- failure handling


class FlakyExporter(otel_rl.Exporter):
    """Fails with ConnectionError until released (and at least `k` times), then ValueError twice, then works."""

    def __init__(self, k: int):
        self.name = f"flaky-{uuid.uuid4().hex[:8]}"
        self.k = k
        self.release = threading.Event()
        self.calls = 0
        self.calls_released = 0
        self.received: list = []

    def export_records(self, records):
        self.calls += 1
        if self.calls <= self.k or not self.release.is_set():
            raise ConnectionError("collector unreachable")
        self.calls_released += 1
        if self.calls_released <= 2:
            raise ValueError("bad gateway")
        self.received.extend(records)


def test_failing_exporter_retries_and_delivers_exactly_once_in_order(caplog):
    caplog.set_level(logging.WARNING, logger="otel_rl")
    flaky = FlakyExporter(k=3)
    h = _init([flaky])
    try:
        for i in range(5):
            otel_rl.log({"i": i}, step=i)
        assert _wait_for(lambda: h.stats()["exporters"][flaky.name]["failed_attempts"] >= 1)
        # the exporter is failing (not released): log() still returns at once, without raising
        for i in range(5, 40):
            assert otel_rl.log({"i": i, "x": i / 2}, step=i) is None
        s = h.stats()["exporters"][flaky.name]
        assert s["exported"] == 0 and s["queued"] > 0
        flaky.release.set()
        assert h.flush(60), h.stats()
        stats = h.stats()["exporters"][flaky.name]
    finally:
        h.shutdown()
    steps = [r.step for r in flaky.received if isinstance(r, StepMetrics)]
    assert steps == list(range(40))  # all, exactly once, in order
    assert [r.values["i"] for r in flaky.received if isinstance(r, StepMetrics)] == list(range(40))
    assert sum(isinstance(r, RunStart) for r in flaky.received) == 1
    assert stats["failed_attempts"] >= 3 + 2
    assert stats["retried"] >= 3 + 2
    assert stats["dropped"] == 0 and stats["queued"] == 0
    assert stats["exported"] == len(flaky.received) == 41
    warnings = [r for r in caplog.records if flaky.name in r.getMessage() and "failed (" in r.getMessage()]
    kinds = sorted(r.getMessage().split("failed (")[1].split(":")[0] for r in warnings)
    assert kinds == ["ConnectionError", "ValueError"]  # one warning per exception kind


class AlwaysFailing(otel_rl.Exporter):
    def __init__(self):
        self.name = f"down-{uuid.uuid4().hex[:8]}"

    def export_records(self, records):
        raise ConnectionRefusedError("nobody home")


def test_always_failing_exporter_shutdown_is_bounded_and_counts_dropped(caplog):
    caplog.set_level(logging.WARNING, logger="otel_rl")
    bad, bad2 = AlwaysFailing(), AlwaysFailing()
    cap = CaptureExporter()
    h = _init([bad, bad2, cap])
    for i in range(10):
        otel_rl.log({"loss": float(i)}, step=i)
    assert _wait_for(lambda: h.stats()["exporters"][bad.name]["failed_attempts"] >= 2)
    t0 = time.monotonic()
    h.shutdown(timeout_s=1.0)
    took = time.monotonic() - t0
    assert took < 1.0 + 1.0, f"shutdown(timeout_s=1) took {took:.2f}s"
    for e in (bad, bad2):
        s = h.stats()["exporters"][e.name]
        assert s["exported"] == 0
        assert s["dropped"] == 11  # run start + 10 steps, counted
        assert s["queued"] == 0
    # the healthy exporter got everything
    assert [m.step for m in cap.step_metrics()] == list(range(10))
    assert any("still failing at shutdown" in r.getMessage() and bad.name in r.getMessage() for r in caplog.records)
    otel_rl.log({"after": 1.0}, step=11)  # a no-op after shutdown, never raises


class SlowExporter(otel_rl.Exporter):
    def __init__(self):
        self.name = f"slow-{uuid.uuid4().hex[:8]}"
        self.release = threading.Event()
        self.received: list = []

    def export_records(self, records):
        deadline = time.monotonic() + 30
        while not self.release.is_set() and time.monotonic() < deadline:
            time.sleep(0.02)  # a slow network call
        self.received.extend(records)


def test_slow_exporter_does_not_delay_others():
    slow = SlowExporter()
    cap = CaptureExporter()
    h = _init([slow, cap])
    try:
        for i in range(3):
            otel_rl.log({"v": i}, step=i)
        assert _wait_for(lambda: len(cap.step_metrics()) == 3, timeout_s=10)
        assert [m.step for m in cap.step_metrics()] == [0, 1, 2]
        assert not any(isinstance(r, StepMetrics) for r in slow.received)  # still stuck in its first batch
        slow.release.set()
        assert h.flush(30)
    finally:
        slow.release.set()
        h.shutdown()
    assert [r.step for r in slow.received if isinstance(r, StepMetrics)] == [0, 1, 2]


# ----------------------------------------------------------------------------- exporter lookup


def test_unknown_exporter_name_lists_installed(monkeypatch):
    with pytest.raises(otel_rl.UnknownExporterError) as ei:
        otel_rl.init(exporters=["console", "no-such-exporter"], project="p", experiment="e")
    msg = str(ei.value)
    assert "no-such-exporter" in msg
    for name in ("console", "file", "jsonl", "memory", "otlp", "prometheus"):
        assert name in msg
    assert otel_rl.current() is None  # nothing started
    # as on a machine without the otel-rl-mlflow distribution (it may be installed here)
    real = registry._entry_points
    monkeypatch.setattr(registry, "_entry_points", lambda: {k: v for k, v in real().items() if k != "mlflow"})
    with pytest.raises(otel_rl.UnknownExporterError, match=r"pip install 'otel-rl\[mlflow\]'"):
        registry.resolve_factory("mlflow")
    with pytest.raises(otel_rl.UnknownExporterError, match="no otel-rl exporter"):
        registry.resolve_factory("vemlp_wandb")


def test_entry_points_resolve_builtin_exporters():
    from importlib import metadata

    names = registry.installed_names()
    assert {"console", "file", "jsonl", "otlp", "prometheus", "memory"} <= set(names)
    eps = {ep.name: ep for ep in metadata.entry_points(group=registry.GROUP)}
    assert {"console", "file", "jsonl", "otlp", "prometheus", "memory"} <= set(eps)
    from otel_rl.exporters.jsonl import JsonlExporter
    from otel_rl.exporters.otlp import OtlpExporter
    from otel_rl.exporters.prometheus import PrometheusExporter

    expected = {"console": ConsoleExporter, "file": JsonlExporter, "jsonl": JsonlExporter, "otlp": OtlpExporter,
                "prometheus": PrometheusExporter, "memory": CaptureExporter}
    for name, cls in expected.items():
        assert eps[name].load() is cls
        assert registry.resolve_factory(name) is cls
    e = registry.create("memory", None)
    assert isinstance(e, CaptureExporter) and e.name == "memory"
