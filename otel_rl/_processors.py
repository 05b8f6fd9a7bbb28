"""The span processors and metric readers outside otel-rl that see what it records.

Two kinds, both fed by default:

- processors added to otel-rl's own provider (``handle.tracer_provider.add_span_processor(...)``);
- a global SDK `TracerProvider` / `MeterProvider` the user set up before `init()`
  (``opentelemetry-instrument``, ``logfire.configure()``, their own ``set_tracer_provider``): otel-rl's
  spans go to its span processors, and otel-rl's metric instruments are made on its meter provider too.
  ``feed_global_provider=false`` keeps everything private.

Every span is the SDK's `ReadableSpan` (otel-rl's light span, otel_rl._lightspan), the same object at
``on_start`` and ``on_end``.  ``on_start`` runs on the thread that starts the span (the training thread;
for ``rl.log`` and ``rl.generations``, made by otel-rl's pipeline thread, that one), so that it sees the
span while it is open, as with the SDK's own spans; ``on_end`` runs on otel-rl's pipeline thread, with
the span materialised there (an op's inputs and output as JSON text, token2text's texts).  A provider
that a tracker library installs while otel-rl's exporters start is not the user's pipeline: only a
provider set before `init()` is fed.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from opentelemetry import metrics as metrics_api
from opentelemetry import trace as trace_api
from opentelemetry.sdk.metrics import MeterProvider as SdkMeterProvider
from opentelemetry.sdk.trace import ReadableSpan, SpanProcessor
from opentelemetry.sdk.trace import TracerProvider as SdkTracerProvider

from . import _runtime

if TYPE_CHECKING:
    from .config import Config

_log = logging.getLogger("otel_rl")


def _sdk(provider: Any, kind: type) -> Any:
    """`provider` if it is the SDK's, or the SDK provider a proxy of a library keeps as its ``provider``
    (logfire's), else None."""
    if isinstance(provider, kind):
        return provider
    inner = getattr(provider, "provider", None)
    return inner if isinstance(inner, kind) else None


def _installed_by_tracker(provider: Any, tracker_modules: Iterable[str]) -> bool:
    """Whether a tracker library set `provider` up (weave.init does): one of its span processors comes
    from that library's package.  Its spans are that tracker's, reached through otel-rl's exporter."""
    active = getattr(provider, "_active_span_processor", None)
    roots = set(tracker_modules)
    for p in getattr(active, "_span_processors", ()) or ():
        if type(p).__module__.split(".")[0] in roots:
            return True
    return False


def global_sdk_providers(tracker_modules: Iterable[str] = ()) -> tuple[Any, SdkMeterProvider | None]:
    """The global providers where they are (or wrap) the SDK's and a user set them up (not a tracker
    library whose top-level package is in `tracker_modules`); else None."""
    tp = trace_api.get_tracer_provider()
    mp = metrics_api.get_meter_provider()
    sdk_tp = _sdk(tp, SdkTracerProvider)
    if sdk_tp is None or _installed_by_tracker(sdk_tp, tracker_modules):
        return None, _sdk(mp, SdkMeterProvider)
    return tp, _sdk(mp, SdkMeterProvider)


class OtherProcessors:
    """The span processors outside otel-rl's pipeline: what the user added to otel-rl's provider, and
    the global provider's (see the module doc).  `active` is read on every span start."""

    def __init__(self, global_provider: Any = None) -> None:
        self._added: tuple[SpanProcessor, ...] = ()
        # the global provider's processors, through the provider (its processor list may grow later)
        self._global = global_provider
        self.active = global_provider is not None

    def add(self, processor: SpanProcessor) -> None:
        self._added = self._added + (processor,)
        self.active = True

    def _targets(self) -> Iterable[Any]:
        yield from self._added
        if self._global is not None:
            # looked up each time: a proxy (logfire's) may point at a new SDK provider after a reconfigure;
            # the SDK keeps a provider's processors in one composite, which has no public accessor
            active = getattr(_sdk(self._global, SdkTracerProvider), "_active_span_processor", None)
            if active is not None:
                yield active

    def on_start(self, span: Any, parent_context: Any = None) -> None:
        for p in self._targets():
            try:
                p.on_start(span, parent_context=parent_context)
            except Exception:  # a user's processor failing must not reach the training code
                _log.exception("otel-rl: a span processor's on_start failed")

    def on_end(self, spans: Iterable[ReadableSpan]) -> None:
        targets = list(self._targets())
        for s in spans:
            for p in targets:
                try:
                    p.on_end(s)
                except Exception:
                    _log.exception("otel-rl: a span processor's on_end failed")

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        ok = True
        for p in self._added:  # the global provider is flushed by its owner
            try:
                ok = bool(p.force_flush(timeout_millis)) and ok
            except Exception:
                ok = False
        return ok

    def shutdown(self) -> None:
        for p in self._added:  # the global provider is shut down by its owner
            try:
                p.shutdown()
            except Exception:
                _log.exception("otel-rl: a span processor's shutdown failed")


class OwnProvider(SdkTracerProvider):
    """otel-rl's `TracerProvider`.  Its one active processor hands ended spans to the pipeline;
    `add_span_processor` adds to `others` (fed from the pipeline thread, module doc), and `on_added` lets
    the handle turn tracing on."""

    def __init__(self, others: OtherProcessors, on_added: Any, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.others = others
        self._on_added = on_added

    def add_span_processor(self, span_processor: SpanProcessor) -> None:
        self.others.add(span_processor)
        self._on_added()


class _ForwardingTracerProvider(trace_api.TracerProvider):
    """Installed as the global provider (once): forwards to the current handle's provider."""

    def get_tracer(self, *args: Any, **kwargs: Any) -> trace_api.Tracer:
        h = _runtime.active.handle
        if h is None:
            return trace_api.NoOpTracer()
        return h.tracer_provider.get_tracer(*args, **kwargs)


_forwarding = _ForwardingTracerProvider()


def maybe_set_global(cfg: Config) -> None:
    current = trace_api.get_tracer_provider()
    if current is _forwarding:
        return
    if isinstance(current, trace_api.ProxyTracerProvider) or cfg.set_global_provider:
        if not isinstance(current, trace_api.ProxyTracerProvider):
            _log.warning(
                "otel-rl: a global TracerProvider is already set; otel-rl keeps its own provider "
                "(and feeds the global one's span processors unless feed_global_provider=false)"
            )
            return
        trace_api.set_tracer_provider(_forwarding)
