"""Names and values MLflow accepts.

MLflow accepts a metric, param or tag key when it matches ``^[/\\w.\\- :]*$``
(``\\w`` is Unicode-aware: Chinese and other letters are fine), does not
normalise to another path (no leading or trailing ``/``, no ``//``, no ``.`` or
``..`` segment) and has at most 250 characters.  A key it would reject is
renamed here, deterministically and once per key (one warning each):

1. verl's rule (``verl.utils.tracking._MlflowLoggingAdapter``): ``@`` -> ``_at_``,
   runs of ``/`` collapsed, every other invalid character -> ``_``;
2. leading/trailing ``/`` dropped, ``.``/``..`` segments -> ``_``/``__``;
3. longer than 250 characters: cut, plus ``-`` and 8 hex digits of the SHA-1 of
   the original key (so two long keys with a common prefix stay apart);
4. a renamed key that lands on a name already used by another key gets the same
   hash suffix.

Keys MLflow accepts are never changed (if a renamed key took such a name before the
key itself first appeared, both series share it, with a warning).
"""

from __future__ import annotations

import hashlib
import logging
import posixpath
import re

_log = logging.getLogger("otel_rl")

MAX_KEY_CHARS = 250  # MLflow MAX_ENTITY_KEY_LENGTH
MAX_PARAM_VALUE_CHARS = 6000  # MLflow MAX_PARAM_VAL_LENGTH
MAX_TAG_VALUE_CHARS = 8000  # MLflow MAX_TAG_VAL_LENGTH (runs and traces)
MAX_TRACE_NAME_CHARS = 4096  # MLflow MAX_CHARS_IN_TRACE_INFO_TAGS_VALUE (trace name column)
MAX_EXPERIMENT_NAME_CHARS = 500

_VALID = re.compile(r"^[/\w.\- :]*$")
_INVALID_CHAR = re.compile(r"[^/\w.\- :]")
_SLASHES = re.compile(r"/+")
TRUNCATION_MARK = "...[truncated {} chars]"


def is_valid_key(key: str) -> bool:
    """What MLflow's `_validate_metric_name` / `_validate_param_name` accept (POSIX)."""
    if not key or len(key) > MAX_KEY_CHARS or not _VALID.match(key):
        return False
    norm = posixpath.normpath(key)
    return not (norm != key or norm == "." or norm.startswith("..") or norm.startswith("/"))


def verl_sanitize(key: str) -> str:
    """verl's MLflow key rule: ``@`` -> ``_at_``, collapse ``//``, invalid characters -> ``_``."""
    s = key.replace("@", "_at_")
    s = _SLASHES.sub("/", s)
    return _INVALID_CHAR.sub("_", s)


def _fix_path(s: str) -> str:
    parts = [p for p in s.split("/") if p]
    parts = ["_" if p == "." else "__" if p == ".." else p for p in parts]
    s = "/".join(parts)
    if s.startswith(".."):
        s = "_" + s
    return s or "_"


def key_hash(key: str) -> str:
    return hashlib.sha1(key.encode("utf-8", "surrogatepass")).hexdigest()[:8]


def _with_suffix(s: str, original: str) -> str:
    suffix = "-" + key_hash(original)
    head = s[: MAX_KEY_CHARS - len(suffix)].rstrip("/")
    out = head + suffix
    if not is_valid_key(out):  # pragma: no cover - defensive: the head is a valid path prefix
        out = "key" + suffix
    return out


class KeyMapper:
    """Original key -> the key sent to MLflow; stable for the life of the exporter."""

    def __init__(self, what: str):
        self.what = what  # "metric" / "param", for the warning
        self._map: dict[str, str] = {}
        self._owner: dict[str, str] = {}  # MLflow key -> original key

    def __call__(self, key: str) -> str:
        out = self._map.get(key)
        if out is None:
            out = self._new(key)
        return out

    def _new(self, key: str) -> str:
        reason = ""
        s = key
        if not is_valid_key(key):
            s = _fix_path(verl_sanitize(key))
            if s != key:
                reason = "characters or path form MLflow rejects"
            if len(s) > MAX_KEY_CHARS:
                s = _with_suffix(s, key)
                reason = (reason + "; " if reason else "") + f"longer than {MAX_KEY_CHARS} characters"
        owner = self._owner.get(s)
        if owner is not None and owner != key:
            if s == key:
                # a key MLflow accepts keeps its name even when a renamed key took it first
                _log.warning(
                    "otel-rl: MLflow %s key %r is also the renamed form of %r; their points share it",
                    self.what,
                    key,
                    owner,
                )
            else:
                s = _with_suffix(s, key)
                reason = (reason + "; " if reason else "") + f"{self._map.get(owner, owner)!r} is taken by {owner!r}"
        self._owner.setdefault(s, key)
        self._map[key] = s
        if s != key:
            _log.warning("otel-rl: MLflow %s key %r logged as %r (%s)", self.what, key, s, reason)
        return s


def truncate(value: str, limit: int) -> tuple[str, bool]:
    """Cut `value` to `limit` characters with a visible marker; (text, truncated)."""
    if len(value) <= limit:
        return value, False
    cut = len(value) - limit
    while True:
        mark = TRUNCATION_MARK.format(cut)
        keep = limit - len(mark)
        if len(value) - keep == cut:
            return value[:keep] + mark, True
        cut = len(value) - keep


def param_value(value: object) -> str:
    """How `mlflow.log_params` turns a value into a param string (verl logs through it)."""
    return value if isinstance(value, str) else str(value)


def shorten_name(name: str, limit: int) -> str:
    """An experiment or run name MLflow stores (bounded column): cut with a hash suffix."""
    if len(name) <= limit:
        return name
    suffix = "-" + key_hash(name)
    return name[: limit - len(suffix)] + suffix
