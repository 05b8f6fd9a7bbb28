"""The types of the attributes records are built from, checked on every received span.

OTLP carries any value under any key: a sender can put a string where a step goes, or send
metric keys and values of different lengths.  In the trainer's own process such spans cannot
exist; behind the bridge, one of them would make the record builder (or a tracker exporter)
fail on the whole batch it shares with other senders' spans.  So the bridge checks each span
as it decodes it (docs/semconv.md gives the types) and refuses a wrong one alone: it is reported
in the response's ``partial_success``, counted per reason, and the rest of the request goes on.

A reason is one of a fixed set of short texts (they label the bridge's span counter).
"""

from __future__ import annotations

import json
from typing import Any

from .. import semconv as sc

__all__ = ["TYPED", "resource_problem", "span_problem", "needs_check"]

# attributes of any span that records or exporters read, with the type they must have when present
_INTS = (
    sc.RL_STEP,
    sc.RL_SAMPLE_INDEX,
    sc.RL_ROLLOUT_N,
    sc.RL_TURN_INDEX,
    sc.GEN_AI_USAGE_INPUT_TOKENS,
    sc.GEN_AI_USAGE_OUTPUT_TOKENS,
)
_BOOLS = (sc.RL_VALIDATE,)
_STRS = (sc.RL_SPAN_KIND, sc.RL_TRAJECTORY_NAME, sc.RL_OP_INPUTS, sc.RL_OP_OUTPUT)
_IDENTITY = (sc.RL_PROJECT_NAME, sc.RL_EXPERIMENT_NAME, sc.RL_RUN_ID)

# key -> the one type its value must have (the decoder compares while it decodes, `span_problem` says why)
TYPED: dict[str, type] = {**dict.fromkeys(_INTS, int), **dict.fromkeys(_BOOLS, bool), **dict.fromkeys(_STRS, str)}

# (keys, values, what a value must be) of a log() call's typed arrays
_METRIC_PAIRS = (
    (sc.RL_METRICS_KEYS, sc.RL_METRICS_VALUES, "number"),
    (sc.RL_METRICS_INT_KEYS, sc.RL_METRICS_INT_VALUES, "int"),
    (sc.RL_METRICS_BOOL_KEYS, sc.RL_METRICS_BOOL_VALUES, "bool"),
)
_GENERATIONS = (
    (sc.RL_GENERATIONS_INPUTS, "str"),
    (sc.RL_GENERATIONS_OUTPUTS, "str"),
    (sc.RL_GENERATIONS_SCORES, "number"),
)
_TYPES = {
    "int": frozenset({int}),
    "number": frozenset({float, int}),
    "bool": frozenset({bool}),
    "str": frozenset({str}),
}
_ARTICLE = {"int": "integers", "number": "numbers", "bool": "booleans", "str": "strings"}


def _is_int(v: Any) -> bool:
    return type(v) is int  # a bool is not a step


def _array(attrs: Any, key: str, kind: str) -> tuple[tuple | None, str | None]:
    """The array under `key` (absent: empty), or a reason it is not an array of `kind`."""
    v = attrs.get(key)
    if v is None:
        return (), None
    if type(v) is not tuple:
        return None, f"{key} must be an array"
    if not _TYPES[kind].issuperset(map(type, v)):  # (exact types: a bool is not an int here)
        return None, f"{key} must hold {_ARTICLE[kind]}"
    return v, None


def resource_problem(attrs: Any) -> str | None:
    """Why spans of a resource with these attributes cannot make records, or None."""
    for key in _IDENTITY:
        v = attrs.get(key)
        if v is not None and type(v) is not str:
            return f"resource attribute {key} must be a string"
    rank = attrs.get(sc.RL_WORKER_RANK)
    if rank is not None and not _is_int(rank):
        return f"resource attribute {sc.RL_WORKER_RANK} must be an integer"
    return None


def needs_check(name: str, attrs: Any, has_parent: bool) -> bool:
    """Whether a span whose `TYPED` attributes all have their type can still fail `span_problem`."""
    if name == sc.SPAN_RUN:
        return not has_parent
    return (name == sc.SPAN_LOG or name == sc.SPAN_GENERATIONS) and sc.RL_STEP in attrs


def span_problem(name: str, attrs: Any, has_parent: bool) -> str | None:
    """Why a span with this name and these attributes cannot make records, or None."""
    if not attrs:
        return None
    for key in _INTS:
        v = attrs.get(key)
        if v is not None and not _is_int(v):
            return f"{key} must be an integer"
    for key in _BOOLS:
        v = attrs.get(key)
        if v is not None and type(v) is not bool:
            return f"{key} must be a boolean"
    for key in _STRS:
        v = attrs.get(key)
        if v is not None and type(v) is not str:
            return f"{key} must be a string"
    if sc.RL_STEP in attrs:
        if name == sc.SPAN_LOG:
            return _log_problem(attrs)
        if name == sc.SPAN_GENERATIONS:
            return _generations_problem(attrs)
    if name == sc.SPAN_RUN and not has_parent:
        return _run_problem(attrs)
    return None


def _log_problem(attrs: Any) -> str | None:
    for keys_key, values_key, kind in _METRIC_PAIRS:
        keys, why = _array(attrs, keys_key, "str")
        if why:
            return why
        values, why = _array(attrs, values_key, kind)
        if why:
            return why
        if len(keys) != len(values):  # type: ignore[arg-type]
            return f"{keys_key} and {values_key} differ in length"
    return None


def _generations_problem(attrs: Any) -> str | None:
    n = None
    for key, kind in _GENERATIONS:
        values, why = _array(attrs, key, kind)
        if why:
            return why
        if n is None:
            n = len(values)  # type: ignore[arg-type]
        elif len(values) != n:  # type: ignore[arg-type]
            return f"{sc.RL_GENERATIONS_INPUTS}, outputs and scores differ in length"
    return None


def _run_problem(attrs: Any) -> str | None:
    text = attrs.get(sc.RL_RUN_CONFIG)
    if text is None:
        return None
    if type(text) is not str:
        return f"{sc.RL_RUN_CONFIG} must be a string"
    try:
        config = json.loads(text or "{}")
    except (ValueError, RecursionError):
        return f"{sc.RL_RUN_CONFIG} must be a JSON object"
    if not isinstance(config, dict):
        return f"{sc.RL_RUN_CONFIG} must be a JSON object"
    return None
