"""SwanLab's metric-key rules, applied before a key reaches SwanLab.

SwanLab 0.10 (``swanlab/sdk/internal/run/fmt.py:validate_key`` and
``swanlab/sdk/internal/pkg/constraints``) accepts a key of 1-512 characters
with no control character (``\\x00-\\x1f``, ``\\x7f``) that does not start or end
with ``.`` or ``/``.  It strips leading/trailing whitespace, ``.`` and ``/``,
truncates longer keys, *drops* a metric whose key contains a control
character, and skips keys starting with its system prefix ``__swanlab__.``.
Keys that become equal after that silently overwrite each other.

Here every key is mapped once per run to a key SwanLab keeps as it is:
control characters become ``_``, edges are stripped, long keys are cut,
the system prefix gets a leading ``_``, lone UTF-16 surrogates (which the
protobuf writer cannot encode) become U+FFFD, and a key that would collide
with another one of the same run gets a ``~<hash>`` suffix.  Each changed key
is reported once, with its original and new spelling.
"""

from __future__ import annotations

import hashlib
import logging
import re

from otel_rl.exporters.base import warn_once

_log = logging.getLogger("otel_rl")

KEY_MAX_LEN = 512
SYSTEM_PREFIX = "__swanlab__."
_EDGE = " \t\n\r./"
_CONTROL = re.compile(r"[\x00-\x1f\x7f]")
_SURROGATE = re.compile(r"[\ud800-\udfff]")


def clean_text(text: str) -> str:
    """`text` with lone surrogates replaced by U+FFFD (SwanLab writes UTF-8 protobuf and files)."""
    return _SURROGATE.sub("\ufffd", text) if _SURROGATE.search(text) else text


def sanitize_key(key: object) -> str:
    """The key SwanLab keeps for `key` (without collision handling)."""
    k = clean_text(str(key))
    k = _CONTROL.sub("_", k).strip(_EDGE)
    if k.startswith(SYSTEM_PREFIX):
        k = "_" + k
    if len(k) > KEY_MAX_LEN:
        k = k[:KEY_MAX_LEN].rstrip(_EDGE)
    return k or "_"


class KeyMap:
    """original key -> SwanLab key, stable for one run, collision-free."""

    def __init__(self) -> None:
        self._out: dict[str, str] = {}
        self._owner: dict[str, str] = {}  # SwanLab key -> original key

    def __call__(self, key: str) -> str:
        out = self._out.get(key)
        if out is not None:
            return out
        out = sanitize_key(key)
        if self._owner.get(out, key) != key:
            digest = hashlib.sha1(key.encode("utf-8", "surrogatepass")).hexdigest()
            n = 8
            while True:
                suffix = "~" + digest[:n]
                cand = (out[: KEY_MAX_LEN - len(suffix)].rstrip(_EDGE) or "_") + suffix
                if self._owner.get(cand, key) == key:
                    out = cand
                    break
                n += 4  # pragma: no cover - a sha1 prefix collision
        self._owner[out] = key
        self._out[key] = out
        if out != key:
            warn_once(
                f"swanlab-key:{key}",
                "otel-rl: metric key %r is logged to SwanLab as %r (SwanLab keys: at "
                "most 512 characters, no control characters, no leading/trailing ' ./', distinct)",
                key,
                out,
            )
        return out

    def items(self) -> list[tuple[str, str]]:
        return list(self._out.items())
