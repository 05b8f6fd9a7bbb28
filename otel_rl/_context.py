"""OpenTelemetry's current context, read and set in one step.

Every traced op makes its span current for the time of its call and reads the current span to
find its parent.  Through the API that is ``attach(set_span_in_context(span))`` (six Python calls:
``set_value``, ``get_current`` and the runtime context's own methods), ``detach(token)`` and
``get_current_span()`` (four more).  With the API's default runtime context (one `ContextVar`
holding the current `Context`), the same is one read or one set of that variable; the functions
here do that, and fall back to the API itself when another runtime context is configured
(``OTEL_PYTHON_CONTEXT``).  What they store and return is what the API would: the same `Context`
(a copy of the current one with the span under the API's key), the same tokens.
"""

from __future__ import annotations

from contextvars import ContextVar, Token
from typing import Any

from opentelemetry import context as otel_context
from opentelemetry import trace as trace_api

try:
    from opentelemetry.trace.propagation import _SPAN_KEY
except ImportError:  # pragma: no cover - a future API that moved it: the API's own calls below
    _SPAN_KEY = None

_Context = otel_context.Context
_Span = trace_api.Span
_INVALID = trace_api.INVALID_SPAN


def _runtime_var() -> ContextVar | None:
    """The `ContextVar` of the API's runtime context, when it is the default one (else None)."""
    try:
        from opentelemetry.context.contextvars_context import ContextVarsRuntimeContext
    except ImportError:  # pragma: no cover
        return None
    rt = getattr(otel_context, "_RUNTIME_CONTEXT", None)
    var = getattr(rt, "_current_context", None)
    if _SPAN_KEY is None or type(rt) is not ContextVarsRuntimeContext or not isinstance(var, ContextVar):
        return None
    return var


_VAR = _runtime_var()
DIRECT = _VAR is not None  # whether the one-step path is in use (tests check both)

if _VAR is not None:
    _get = _VAR.get
    _set = _VAR.set
    _reset = _VAR.reset

    def attach_span(span: Any, base: Any = None) -> Token:
        """Make `span` current, in a copy of `base` (default: the current context); a token for `detach`."""
        return _set(_Context({**(_get() if base is None else base), _SPAN_KEY: span}))

    def detach(token: Token) -> None:
        """Restore the context from before `attach_span`; never raises (as the API's ``detach``)."""
        try:
            _reset(token)
        except Exception:
            otel_context.detach(token)  # fails the same way and logs it, as the API does

    def current_span() -> Any:
        """The current span (``INVALID_SPAN`` when there is none), as ``get_current_span()``."""
        span = _get().get(_SPAN_KEY)
        return span if span is not None and isinstance(span, _Span) else _INVALID

    def current_raw() -> Any:
        """What the current context holds under the span key (anything, or None): callers that recognise
        their own span type by ``type(...) is`` read it without ``current_span``'s ABC check."""
        return _get().get(_SPAN_KEY)

else:  # another runtime context: the API's own calls (tests: test_another_runtime_context_goes_through_the_api)

    def attach_span(span: Any, base: Any = None) -> Token:
        return otel_context.attach(trace_api.set_span_in_context(span, base))

    detach = otel_context.detach
    current_span = trace_api.get_current_span

    def current_raw() -> Any:  # the checked span: callers' `type(...) is` tests work the same on it
        return current_span()
