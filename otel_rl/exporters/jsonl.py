"""`file` / `jsonl`: one JSON object per `log()` call, ``{"step":N,"data":{...}}``.

The bytes match verl's file logger, ``orjson.dumps({"step": step, "data": data})
+ b"\\n"`` (compact separators, keys in the order logged, UTF-8, orjson's float
text such as ``1e-6`` and ``0.00001``): orjson itself when it is installed,
otherwise the same text built here.  Where verl writes ``null`` for NaN and
+-Inf (losing which one it was), otel-rl writes the strings ``"NaN"``,
``"Infinity"`` and ``"-Infinity"``: the file stays valid JSON for strict
readers and nothing is lost (`otel_rl.serialize.parse_json_float` turns them
back).  A key with a lone surrogate code point (which orjson, and so verl,
cannot write) has it replaced by U+FFFD, so every line is valid UTF-8 and JSON.

Path: config ``jsonl_path`` (``OTEL_RL_JSONL_PATH``) > ``VERL_FILE_LOGGER_PATH``
> ``$VERL_FILE_LOGGER_ROOT/<project>/<experiment>.jsonl`` (root default ``.``).
The file is appended to, so a restarted run continues it.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from typing import Any

from ..records import StepMetrics
from ..serialize import json_float
from .base import Exporter

try:
    import orjson as _orjson
except ImportError:  # pragma: no cover - orjson is optional
    _orjson = None


def _float_text(v: float) -> str:
    """A finite float as orjson writes it: ``repr`` except ``1e-6`` (not ``1e-06``), ``0.00001``."""
    r = repr(v)
    mant, sep, exp = r.partition("e")
    if not sep:
        return r
    e = int(exp)
    if e == -5:
        sign = "-" if mant.startswith("-") else ""
        return sign + "0.0000" + mant.lstrip("-").replace(".", "")
    return f"{mant}e{'+' if e > 0 else '-'}{abs(e)}"


def _str_text(s: str) -> str:
    text = json.dumps(s, ensure_ascii=False)
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        # surrogate code points: a pair becomes its character, a lone one U+FFFD (a "\\ud800" escape
        # would be JSON that strict readers refuse: it is no Unicode character)
        text = json.dumps(s.encode("utf-16", "surrogatepass").decode("utf-16", "replace"), ensure_ascii=False)
    return text


def _value_text(v: Any) -> str:
    if v is True or v is False:
        return "true" if v else "false"
    if isinstance(v, int):
        return str(int(v))
    if isinstance(v, float):
        return _float_text(v)
    return _str_text(str(v))


def _encode_fallback(step: int, clean: dict[str, Any]) -> bytes:
    body = ",".join(f"{_str_text(str(k))}:{_value_text(v)}" for k, v in clean.items())
    return ('{"step":' + str(int(step)) + ',"data":{' + body + "}}\n").encode("utf-8")


def encode_line(step: int, data: dict[str, Any]) -> bytes:
    clean = {k: json_float(v) for k, v in data.items()}
    if _orjson is not None:
        try:
            return _orjson.dumps({"step": step, "data": clean}) + b"\n"
        except TypeError:  # ints beyond 64 bits, lone surrogates: orjson (so verl) cannot write them
            pass
    return _encode_fallback(step, clean)


def resolve_path(config: Any) -> str:
    path = getattr(config, "jsonl_path", None) or os.environ.get("VERL_FILE_LOGGER_PATH")
    if path:
        return os.path.expanduser(path)
    root = os.path.expanduser(os.environ.get("VERL_FILE_LOGGER_ROOT", "."))
    project = getattr(config, "project", "otel_rl")
    experiment = getattr(config, "experiment", "default")
    return os.path.join(root, project, f"{experiment}.jsonl")


class JsonlExporter(Exporter):
    gathers = True  # lines written about once per `export_interval_s` and at every flush (as the console)

    def __init__(self, config: Any = None):
        self.path = resolve_path(config)
        parent = os.path.dirname(self.path)
        try:
            if parent:
                os.makedirs(parent, exist_ok=True)
            self._fp = open(self.path, "ab")
        except OSError as exc:
            from ..config import ConfigError

            source = ("jsonl_path" if getattr(config, "jsonl_path", None) else
                      "VERL_FILE_LOGGER_PATH" if os.environ.get("VERL_FILE_LOGGER_PATH") else
                      "VERL_FILE_LOGGER_ROOT/<project>/<experiment>.jsonl")
            raise ConfigError(f"the JSONL file {os.path.abspath(self.path)!r} (from {source}) cannot be opened for "
                              f"appending: {exc.strerror or exc}") from exc
        print(f"Creating file logger at {os.path.abspath(self.path)}", flush=True)  # as verl prints it

    def export_records(self, records: Sequence[Any]) -> None:
        chunks = [encode_line(r.step, r.values) for r in records if isinstance(r, StepMetrics)]
        if chunks:
            self._fp.write(b"".join(chunks))
            self._fp.flush()

    def flush(self, timeout_s: float = 10.0) -> None:
        if not self._fp.closed:
            self._fp.flush()

    def shutdown(self) -> None:
        if not self._fp.closed:
            self._fp.close()
