"""The machinery of the op decorators (`op`, `generate`, `tool` in otel_rl.instrument): what a decorated
function's wrapper does on every call, for plain functions, coroutines, generators and async generators.

A call inside a sampled trajectory (or outside any, with tracing on) gets a light span under the current
span, made current for the call; its inputs and output are snapshotted (`serialize.snapshot`) and become
JSON off the training thread; a token2text job stays in the span (`_runtime.active.decode_later`).
"""

from __future__ import annotations

import functools
import inspect
import time
from collections.abc import Callable
from typing import Any

from opentelemetry import context as otel_context
from opentelemetry import trace as trace_api
from opentelemetry.trace import Status, StatusCode

from . import _runtime
from . import semconv as sc
from ._runtime import TRAJECTORY
from ._token2text import pending_entry, raw_ids
from .serialize import snapshot, to_json

#: a trajectory's modes: not traced, traced for its statistics only, traced
OFF, UNSAMPLED, SAMPLED = 0, 1, 2
_time_ns = time.time_ns
# names read on every traced op call (one global lookup instead of a global and an attribute)
_OP_INPUTS, _OP_OUTPUT, _TRUNCATED, _KIND_LLM = sc.RL_OP_INPUTS, sc.RL_OP_OUTPUT, sc.RL_TRUNCATED, sc.KIND_LLM


def record_exception(span: Any, exc: BaseException, timestamp: int | None = None) -> None:
    try:
        span.record_exception(exc, attributes={sc.ERROR_TYPE: type(exc).__qualname__}, timestamp=timestamp)
        span.set_status(Status(StatusCode.ERROR, f"{type(exc).__name__}: {exc}"[:1024]))
        span.set_attribute(sc.ERROR_TYPE, type(exc).__qualname__)
    except Exception:  # pragma: no cover - never let telemetry raise
        pass


class OpMeta:
    __slots__ = (
        "fn",
        "name",
        "kind",
        "attrs",
        "pos_names",
        "skip_first",
        "varargs",
        "defaults",
        "is_method",
        "tool_call_arg",
        "model",
        "order",
    )

    def __init__(
        self,
        fn: Callable,
        name: str | None,
        kind: str,
        attrs: dict,
        tool_call_arg: tuple = (),
        model: str | None = None,
    ):
        self.fn = fn
        qualname = getattr(fn, "__qualname__", getattr(fn, "__name__", "op"))
        self.name = name or qualname
        self.kind = kind
        self.attrs = attrs if self.name == qualname else {**attrs, sc.RL_OP_QUALNAME: qualname}
        self.tool_call_arg = tool_call_arg
        self.model = model
        try:
            params = list(inspect.signature(fn).parameters.values())
        except (TypeError, ValueError):
            params = []
        self.is_method = bool(params) and params[0].name in ("self", "cls")
        self.skip_first = self.is_method
        pos = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
        if self.skip_first and pos:
            pos = pos[1:]
        self.pos_names = tuple(p.name for p in pos)
        var = [p for p in params if p.kind == p.VAR_POSITIONAL]
        self.varargs = var[0].name if var else "args"
        self.defaults = {
            p.name: p.default
            for p in params
            if p.default is not p.empty and p.kind != p.VAR_KEYWORD and not (self.skip_first and p is params[0])
        }
        # declared names (VAR_POSITIONAL under its own name, **kwargs last) to order keyword calls by
        self.order = tuple(p.name for p in params[1 if self.skip_first else 0 :] if p.kind != p.VAR_KEYWORD)

    def bind(self, args: tuple, kwargs: dict) -> dict[str, Any]:
        """Arguments by parameter name (declaration order, defaults filled in), without self."""
        if self.skip_first:
            args = args[1:]
        names = self.pos_names
        n = len(names)
        if len(args) <= n:
            d = dict(zip(names, args))
        else:
            d = dict(zip(names, args[:n]))
            d[self.varargs] = list(args[n:])
        if kwargs:
            d.update(kwargs)
        if self.defaults:
            for k, v in self.defaults.items():
                if k not in d:
                    d[k] = v
        if kwargs:  # keyword arguments may come in any order: restore declaration order
            ordered = {k: d.pop(k) for k in self.order if k in d}
            ordered.update(d)
            d = ordered
        return d


def _start_op_span(meta: OpMeta, args: tuple, kwargs: dict) -> Any:
    inputs = meta.bind(args, kwargs)
    text, truncated = snapshot(
        inputs, _runtime.active.config.max_value_chars
    )  # its JSON text, or a copy made into it when read
    attrs = {**meta.attrs, _OP_INPUTS: text}
    if truncated:
        attrs[_TRUNCATED] = True
    if meta.tool_call_arg:
        for a in meta.tool_call_arg:
            v = inputs.get(a)
            if v is not None:
                attrs[sc.GEN_AI_TOOL_CALL_ID] = str(v)
                break
    span = _runtime.active.light.start_in_current(meta.name, attrs)
    if type(text) is bytes:
        span._deferred = True  # a copy, made into JSON text off this thread (otel_rl._lightspan.materialise)
    return span


def _usage_from(result: Any, ids: tuple | None) -> tuple[int | None, int | None]:
    pin = pout = None
    if ids is not None:
        p, r = ids
        pin = len(p) if p is not None and hasattr(p, "__len__") else None
        pout = len(r) if r is not None and hasattr(r, "__len__") else None
    usage = result.get("usage") if isinstance(result, dict) else getattr(result, "usage", None)
    if usage is not None:
        get = usage.get if isinstance(usage, dict) else (lambda k, _u=usage: getattr(_u, k, None))
        pin = get("input_tokens") or get("prompt_tokens") or pin
        pout = get("output_tokens") or get("completion_tokens") or pout
    return pin, pout


def _finish_op_span(span: Any, meta: OpMeta, result: Any, args: tuple) -> None:
    # `span` is a LightSpan (the runtime's light tracer) still recording: otel-rl's own attributes, valid by
    # construction, go straight into its attribute dict
    attrs = span._attributes
    text, truncated = snapshot(result, _runtime.active.config.max_value_chars)
    attrs[_OP_OUTPUT] = text
    if type(text) is bytes:
        span._deferred = True
    elif truncated:
        attrs[_TRUNCATED] = True
    ids = None
    if meta.kind == _KIND_LLM:
        try:
            ids = raw_ids(result)  # (only their lengths are read here)
            pin, pout = _usage_from(result, ids)
            if pin is not None:
                attrs[sc.GEN_AI_USAGE_INPUT_TOKENS] = int(pin)
            if pout is not None:
                attrs[sc.GEN_AI_USAGE_OUTPUT_TOKENS] = int(pout)
        except Exception:
            pass
    if _runtime.active.config.token2text:
        tok = _runtime.active.tokenizer
        if tok is None and meta.is_method and args:
            tok = getattr(args[0], "tokenizer", None)
        if tok is not None:
            entry = pending_entry(tok, result, text, _runtime.active.config.max_value_chars, ids)
            if entry is not None:
                _runtime.active.decode_later(span, entry)


def _wrap(fn: Callable, meta: OpMeta) -> Callable:
    if inspect.isasyncgenfunction(fn):
        return _wrap_asyncgen(fn, meta)
    if inspect.iscoroutinefunction(fn):
        return _wrap_async(fn, meta)
    if inspect.isgeneratorfunction(fn):
        return _wrap_gen(fn, meta)
    return _wrap_sync(fn, meta)


def _wrap_sync(fn: Callable, meta: OpMeta) -> Callable:
    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        if not _runtime.active.tracing:
            return fn(*args, **kwargs)
        st = TRAJECTORY.get()
        if st is not None and st.mode != SAMPLED:
            if st.mode == OFF:
                return fn(*args, **kwargs)
            t0 = _time_ns()
            try:
                return fn(*args, **kwargs)
            except BaseException as exc:
                st.note_error(meta.name, meta.kind, t0, _time_ns(), exc)
                raise
        span = _start_op_span(meta, args, kwargs)
        token = otel_context.attach(trace_api.set_span_in_context(span))
        try:
            result = fn(*args, **kwargs)
        except BaseException as exc:
            record_exception(span, exc)
            raise
        else:
            _finish_op_span(span, meta, result, args)
            return result
        finally:
            otel_context.detach(token)
            span.end()

    return wrapper


def _wrap_async(fn: Callable, meta: OpMeta) -> Callable:
    @functools.wraps(fn)
    async def wrapper(*args: Any, **kwargs: Any) -> Any:
        if not _runtime.active.tracing:
            return await fn(*args, **kwargs)
        st = TRAJECTORY.get()
        if st is not None and st.mode != SAMPLED:
            if st.mode == OFF:
                return await fn(*args, **kwargs)
            t0 = _time_ns()
            try:
                return await fn(*args, **kwargs)
            except BaseException as exc:
                st.note_error(meta.name, meta.kind, t0, _time_ns(), exc)
                raise
        span = _start_op_span(meta, args, kwargs)
        token = otel_context.attach(trace_api.set_span_in_context(span))
        try:
            result = await fn(*args, **kwargs)
        except BaseException as exc:
            record_exception(span, exc)
            raise
        else:
            _finish_op_span(span, meta, result, args)
            return result
        finally:
            otel_context.detach(token)
            span.end()

    return wrapper


_MAX_ITEMS_KEPT = 1000


def _wrap_gen(fn: Callable, meta: OpMeta) -> Callable:
    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        if not _runtime.active.tracing:
            return (yield from fn(*args, **kwargs))
        st = TRAJECTORY.get()
        if st is not None and st.mode != SAMPLED:
            if st.mode == OFF:
                return (yield from fn(*args, **kwargs))
            t0 = _time_ns()
            try:
                return (yield from fn(*args, **kwargs))
            except BaseException as exc:
                if not isinstance(exc, GeneratorExit):
                    st.note_error(meta.name, meta.kind, t0, _time_ns(), exc)
                raise
        span = _start_op_span(meta, args, kwargs)
        ctx = trace_api.set_span_in_context(span)
        gen = fn(*args, **kwargs)
        items: list = []
        send_value: Any = None
        throw_exc: BaseException | None = None
        try:
            while True:
                token = otel_context.attach(ctx)  # the span is current only while the body runs
                try:
                    if throw_exc is not None:
                        thrown, throw_exc = throw_exc, None
                        item = gen.throw(thrown)
                    else:
                        item = gen.send(send_value)
                except StopIteration as stop:
                    _finish_op_span(
                        span, meta, {"yielded": items, "return": stop.value} if stop.value is not None else items, args
                    )
                    return stop.value
                finally:
                    otel_context.detach(token)
                if len(items) < _MAX_ITEMS_KEPT:
                    items.append(item)
                try:
                    send_value = yield item
                except GeneratorExit:
                    gen.close()
                    span.set_attribute(sc.RL_OP_OUTPUT, to_json(items, _runtime.active.config.max_value_chars)[0])
                    raise
                except BaseException as exc:
                    throw_exc = exc
                    send_value = None
        except GeneratorExit:
            raise
        except BaseException as exc:
            if items:  # what was yielded before the error is still the op's output
                span.set_attribute(sc.RL_OP_OUTPUT, to_json(items, _runtime.active.config.max_value_chars)[0])
            record_exception(span, exc)
            raise
        finally:
            span.end()

    return wrapper


def _wrap_asyncgen(fn: Callable, meta: OpMeta) -> Callable:
    @functools.wraps(fn)
    async def wrapper(*args: Any, **kwargs: Any) -> Any:
        st = TRAJECTORY.get() if _runtime.active.tracing else None
        traced = _runtime.active.tracing and (st is None or st.mode == SAMPLED)
        if not traced:
            t0 = _time_ns()
            try:
                async for item in fn(*args, **kwargs):
                    yield item
            except BaseException as exc:
                if st is not None and st.mode == UNSAMPLED and not isinstance(exc, GeneratorExit):
                    st.note_error(meta.name, meta.kind, t0, _time_ns(), exc)
                raise
            return
        span = _start_op_span(meta, args, kwargs)
        ctx = trace_api.set_span_in_context(span)
        agen = fn(*args, **kwargs)
        items: list = []
        send_value: Any = None
        throw_exc: BaseException | None = None
        try:
            while True:
                token = otel_context.attach(ctx)
                try:
                    if throw_exc is not None:
                        thrown, throw_exc = throw_exc, None
                        item = await agen.athrow(thrown)
                    else:
                        item = await agen.asend(send_value)
                except StopAsyncIteration:
                    _finish_op_span(span, meta, items, args)
                    return
                finally:
                    otel_context.detach(token)
                if len(items) < _MAX_ITEMS_KEPT:
                    items.append(item)
                try:
                    send_value = yield item
                except GeneratorExit:
                    await agen.aclose()
                    span.set_attribute(sc.RL_OP_OUTPUT, to_json(items, _runtime.active.config.max_value_chars)[0])
                    raise
                except BaseException as exc:
                    throw_exc = exc
                    send_value = None
        except GeneratorExit:
            raise
        except BaseException as exc:
            if items:  # what was yielded before the error is still the op's output
                span.set_attribute(sc.RL_OP_OUTPUT, to_json(items, _runtime.active.config.max_value_chars)[0])
            record_exception(span, exc)
            raise
        finally:
            span.end()

    return wrapper


def decorator(fn: Callable | None, build: Callable[[Callable], OpMeta]) -> Any:
    def deco(f: Callable) -> Callable:
        target = f.__func__ if isinstance(f, (staticmethod, classmethod)) else f
        wrapped = _wrap(target, build(target))
        if isinstance(f, staticmethod):
            return staticmethod(wrapped)
        if isinstance(f, classmethod):
            return classmethod(wrapped)
        return wrapped

    return deco(fn) if fn is not None else deco
