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

Whole lines or nothing: a write that fails part-way (disk full, a file-size limit) is cut back to
the end of the last whole line it wrote, and the retry of the same batch resumes with the first line
that is not in the file, so no line is torn and none is written twice.
"""

from __future__ import annotations

import contextlib
import fcntl
import importlib
import json
import os
from collections.abc import Sequence
from types import ModuleType
from typing import Any

from ..records import StepMetrics
from ..serialize import json_float
from .base import Exporter

_orjson: ModuleType | None
try:
    _orjson = importlib.import_module("orjson")
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


def in_use(fd: int) -> None:
    """Mark the open file as written by a live process: a shared ``flock`` held until it is closed, which
    ``otel-rl prune --jsonl`` tests before deleting an old file (several writers may share it).  Where the
    filesystem has no locks, nothing is marked."""
    with contextlib.suppress(OSError):
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)


def is_in_use(path: str) -> bool:
    """Whether a live process holds `path` open as its JSONL file (`in_use`)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    except OSError:
        return False  # no locks on this filesystem: nothing can be told
    finally:
        os.close(fd)  # closing drops a lock taken here
    return False


class JsonlExporter(Exporter):
    gathers = True  # lines written about once per `export_interval_s` and at every flush (as the console)

    def __init__(self, config: Any = None):
        self.path = resolve_path(config)
        parent = os.path.dirname(self.path)
        try:
            if parent:
                os.makedirs(parent, exist_ok=True)
            # unbuffered: every byte that reaches the file is accounted for by `_write_lines`
            self._fp = open(self.path, "ab", buffering=0)
        except OSError as exc:
            from ..config import ConfigError

            source = (
                "jsonl_path"
                if getattr(config, "jsonl_path", None)
                else "VERL_FILE_LOGGER_PATH"
                if os.environ.get("VERL_FILE_LOGGER_PATH")
                else "VERL_FILE_LOGGER_ROOT/<project>/<experiment>.jsonl"
            )
            raise ConfigError(
                f"the JSONL file {os.path.abspath(self.path)!r} (from {source}) cannot be opened for "
                f"appending: {exc.strerror or exc}"
            ) from exc
        in_use(self._fp.fileno())
        self._batch: Any = None  # the batch whose write failed part-way (a retry gets the same list)
        self._lines_done = 0  # ... how many of its lines are in the file
        self._torn = b""  # the start of a line the file could not be cut back from: finished first
        print(f"Creating file logger at {os.path.abspath(self.path)}", flush=True)  # as verl prints it

    def export_records(self, records: Sequence[Any]) -> None:
        lines = [encode_line(r.step, r.values) for r in records if isinstance(r, StepMetrics)]
        if records is not self._batch:  # a new batch (the one that failed part-way was given up)
            self._batch, self._lines_done = records, 0
            if self._torn:
                self._cut_torn()
        self._write_lines(lines[self._lines_done :])
        self._batch, self._lines_done = None, 0

    def _write_lines(self, lines: list[bytes]) -> None:
        """Append `lines`.  On an error the file ends after the last whole line written (counted in
        `_lines_done`, where the retry of the batch starts) and the error goes to the queue."""
        fd = self._fp.fileno()
        torn = self._torn  # the start of lines[0], already in the file
        data = memoryview(b"".join(lines))[len(torn) :]
        start = os.fstat(fd).st_size - len(torn)  # where `lines` begin in the file
        pos = 0
        try:
            while pos < len(data):
                pos += os.write(fd, data[pos:])
        except OSError:
            done = len(torn) + pos  # bytes of `lines` in the file
            whole = n = 0
            while n < len(lines) and whole + len(lines[n]) <= done:
                whole += len(lines[n])
                n += 1
            self._lines_done += n
            self._torn = lines[n][: done - whole] if n < len(lines) else b""
            self._cut_torn(start + whole)
            raise
        self._torn = b""

    def _cut_torn(self, size: int | None = None) -> None:
        """Cut a torn line off the end of the file (`size`: where it starts).  Where the file cannot be
        truncated, the torn start is kept in `_torn` and the retry finishes that line first."""
        if not self._torn:
            return
        fd = self._fp.fileno()
        try:
            os.ftruncate(fd, os.fstat(fd).st_size - len(self._torn) if size is None else size)
            self._torn = b""
        except OSError:
            if self._batch is None or size is None:  # the line it began will not come again: end it
                try:
                    os.write(fd, b"\n")
                    self._torn = b""
                except OSError:
                    pass

    def flush(self, timeout_s: float = 10.0) -> None:
        return None  # nothing is buffered

    def shutdown(self) -> None:
        if not self._fp.closed:
            self._fp.close()
