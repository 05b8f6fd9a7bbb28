"""MLflow's span translation as the direct trace writer runs it (`writer_translation`), and which spans it
leaves as they are (`_signature`, used by `otel_rl_mlflow.direct.rows.RowMaker._content`); the trajectory
*shape* the writer verifies once per kind (`_shape`)."""

from __future__ import annotations

import base64
import json
from collections.abc import Callable, Sequence
from typing import Any

from otel_rl import semconv as sc

from .. import _traces


def stored_attribute(value: Any) -> Any:
    """One span attribute value as MLflow's ``sanitize_attributes`` stores it, without parsing the
    values it leaves alone.  The rule: a JSON text that decodes to a string, which itself decodes to
    a string, an object or an array, is stored decoded once (a value encoded twice); any other value
    as it is.  A JSON text decodes to a string only when its first non-blank character is a quote,
    and to a string, an object or an array only when that character is one of ``"{[`` -- what every
    other value (most of them: objects, numbers, short texts) is told apart by, before any parse."""
    if type(value) is str:
        head = value[:2]
        if head[:1].isspace():  # (rare: the copy lstrip makes is left to these)
            head = value.lstrip()[:2]
        if head[:1] != '"':
            return value
        second = head[1:]
        if second and second not in '"{[\\' and not second.isspace():
            # a JSON text '"x...' whose x is none of these is a string that does not begin with a
            # quote, a brace or a bracket, or no JSON at all: stored as it is, either way (most
            # attribute values: names and kinds, JSON-encoded)
            return value
    try:
        once = json.loads(value)
    except (json.JSONDecodeError, TypeError):
        return value
    if not isinstance(once, str) or once.lstrip()[:1] not in ('"', "{", "["):
        return value
    try:
        twice = json.loads(once)
    except json.JSONDecodeError:
        return value
    return once if isinstance(twice, (str, dict, list)) else value


def quick_sanitize(attributes: dict[str, Any]) -> dict[str, Any]:
    """`stored_attribute` of each value, in a new dict (MLflow's ``sanitize_attributes``, same result)."""
    return {k: stored_attribute(v) for k, v in attributes.items()}


def unpriced_models_remembered(calculate: Callable[..., Any]) -> Callable[..., Any]:
    """MLflow's ``calculate_cost_by_model_and_token_usage``, remembering the models it finds no price
    for.  Each call looks the model up again, and where litellm is not installed it first tries to
    import it -- a failed import searches ``sys.path`` anew every time: ~100 µs per LLM span, the
    largest single part of the writer's translation for a model without a price (a local policy,
    a fine-tuned checkpoint).  Without a provider, MLflow looks a model up in its bundled price
    lists: a model it found no price for there (with tokens to price) has none at any token count,
    and is not looked up again.  With a provider (given, or ``databricks`` from the model's name)
    MLflow may fetch the provider's list over the network: such calls are left alone."""
    unpriced: set[str] = set()

    def calculate_cost(model_name: Any, usage: Any, model_provider: Any = None) -> Any:
        memo = (
            not model_provider
            and type(model_name) is str
            and model_name != ""
            and not model_name.startswith(("databricks-", "databricks/"))
        )
        if memo and model_name in unpriced:
            return None
        cost = calculate(model_name, usage, model_provider)
        if (
            cost is None
            and memo
            and isinstance(usage, dict)
            and (usage.get("input_tokens") or usage.get("output_tokens"))
        ):
            unpriced.add(model_name)
        return cost

    calculate_cost.unpriced = unpriced  # type: ignore[attr-defined]
    return calculate_cost


def writer_translation(translate: Callable[[Any], dict[str, Any]]) -> Callable[[Any], dict[str, Any]]:
    """MLflow's ``translate_span_when_storing`` for this writer only (MLflow's own writes keep the
    original), with two of the functions it calls replaced by ones that give the same results faster:
    `quick_sanitize` for ``sanitize_attributes``, which parses every attribute value, and again when
    the first parse gives a string (~40 % of the cost of the translation for the writer's spans); and
    `unpriced_models_remembered` around ``calculate_cost_by_model_and_token_usage``.  The verification
    compares the rows with MLflow's own, so an MLflow whose rules differ turns the writer off."""
    import types

    code = getattr(translate, "__code__", None)
    if code is None or "sanitize_attributes" not in code.co_names or translate.__closure__:
        return translate
    scope = dict(translate.__globals__)
    scope["sanitize_attributes"] = quick_sanitize
    calculate = scope.get("calculate_cost_by_model_and_token_usage")
    remembered = None
    if "calculate_cost_by_model_and_token_usage" in code.co_names and callable(calculate):
        remembered = scope["calculate_cost_by_model_and_token_usage"] = unpriced_models_remembered(calculate)
    fn = types.FunctionType(code, scope, translate.__name__, translate.__defaults__)
    if remembered is not None:
        fn.unpriced = remembered.unpriced  # type: ignore[attr-defined]
    return fn


# -- spans whose translation changes nothing (`BulkTraceWriter._content`) -----------------------------
_SPAN_TYPE = _traces.ATTR_SPAN_TYPE
_INPUTS = _traces.ATTR_INPUTS
_OUTPUTS = _traces.ATTR_OUTPUTS
_USAGE = _traces.ATTR_TOKEN_USAGE
_MODEL = _traces.ATTR_MODEL
#: the attribute keys the exporter writes (otel_rl_mlflow._traces) besides rl.* and mlflow.traceTag.*
_OWN_KEYS = frozenset(
    {
        _traces.ATTR_REQUEST_ID,
        _SPAN_TYPE,
        _INPUTS,
        _OUTPUTS,
        _USAGE,
        _MODEL,
        sc.GEN_AI_OPERATION_NAME,
        sc.GEN_AI_REQUEST_MODEL,
        sc.GEN_AI_RESPONSE_MODEL,
        sc.GEN_AI_USAGE_INPUT_TOKENS,
        sc.GEN_AI_USAGE_OUTPUT_TOKENS,
        sc.GEN_AI_TOOL_NAME,
        sc.GEN_AI_TOOL_TYPE,
        sc.GEN_AI_TOOL_CALL_ID,
    }
)
#: GenAI attributes whose values (names, not counts or ids) are part of a span's signature
_NAMED = (
    sc.GEN_AI_OPERATION_NAME,
    sc.GEN_AI_REQUEST_MODEL,
    sc.GEN_AI_RESPONSE_MODEL,
    sc.GEN_AI_TOOL_NAME,
    sc.GEN_AI_TOOL_TYPE,
)
_b64 = base64.b64encode
_loads = json.loads
_plain_dumps = json.JSONEncoder(ensure_ascii=False).encode


def _signature(attrs: Any) -> tuple | None:
    """What MLflow's translation of a span of the exporter's own keys depends on, or None for a span
    with other keys (or no span type, or an unknown one: MLflow would look for one)."""
    for k in attrs:
        if k not in _OWN_KEYS and not k.startswith(("rl.", "mlflow.traceTag.")):
            return None
    stype = attrs.get(_SPAN_TYPE)
    if not stype or stype == '"UNKNOWN"':
        return None
    return (tuple(attrs), stype, attrs.get(_MODEL), *(attrs.get(k) for k in _NAMED))


def _status_text(code: Any) -> str:
    return getattr(code, "value", code)


def _shape(spans: Sequence[Any]) -> frozenset:
    """What makes MLflow's treatment of a trajectory differ: its spans' kinds, statuses, attribute keys,
    event names and models (values of other attributes only become JSON text), as a multiset (the
    order of the spans does not matter)."""
    parts: dict[tuple, int] = {}
    for s in spans:
        attrs = s.attributes
        part = (
            s.name,
            s.parent_span_id is None,
            attrs.get(_SPAN_TYPE),
            s.status_code,
            frozenset(attrs),
            tuple(e[0] for e in s.events),
            attrs.get(_MODEL),
            attrs.get("mlflow.llm.provider"),
        )
        parts[part] = parts.get(part, 0) + 1
    return frozenset(parts.items())
