"""The Weave exporter (see the package README for the behaviour in full)."""

from __future__ import annotations

import datetime
import hashlib
import inspect
import json
import logging
import threading
from collections.abc import Sequence
from typing import Any

from otel_rl import semconv as sc
from otel_rl.exporters.base import warn_once
from otel_rl.exporters.tracker import TrackerExporter
from otel_rl.records import RunIdentity, RunStart, SpanNode, Trajectory, int_or_none

_log = logging.getLogger("otel_rl")

#: the key under which every call's OpenTelemetry details sit in its Weave attributes
META_KEY = "otel_rl"
#: inputs of an op whose JSON was cut at `max_value_chars` (not parseable any more)
RAW_INPUTS_KEY = "raw_json"
MAX_EVENTS = 32

# ----------------------------------------------------------------------------- mapping helpers


def call_id(trace_id: int, span_id: int, start_ns: int) -> str:
    """A Weave call id for one span: a UUIDv7 (Weave's id format) whose time is the span's start
    and whose other bits come from the span's trace and span ids, so a re-sent trajectory keeps its ids."""
    v = bytearray(hashlib.blake2b(trace_id.to_bytes(16, "big") + span_id.to_bytes(8, "big"), digest_size=16).digest())
    v[0:6] = (max(0, start_ns) // 1_000_000 & (1 << 48) - 1).to_bytes(6, "big")
    v[6] = (v[6] & 0x0F) | 0x70
    v[8] = (v[8] & 0x3F) | 0x80
    h = v.hex()
    return f"{h[:8]}-{h[8:12]}-{h[12:16]}-{h[16:20]}-{h[20:]}"


def to_datetime(ns: int) -> datetime.datetime | None:
    """A span time (ns since the epoch) as a UTC datetime; ValueError for one no datetime holds
    (the C library's own refusal is an OSError, which would read as a network error and be retried)."""
    if not ns:
        return None
    try:
        return datetime.datetime.fromtimestamp(ns / 1e9, tz=datetime.timezone.utc)
    except (OverflowError, OSError, ValueError) as exc:
        raise ValueError(f"time {ns} ns is outside the range of a datetime ({exc})") from None


_MISSING = object()


def _parse(text: str | None) -> Any:
    if text is None:
        return _MISSING
    try:
        return json.loads(text)
    except ValueError:
        return text  # cut at max_value_chars: no longer JSON; kept as the text


def call_inputs(node: SpanNode) -> dict[str, Any]:
    """The op's bound arguments (a JSON object in ``rl.op.inputs``) as Weave inputs."""
    value = _parse(node.inputs)
    if value is _MISSING:
        return {}
    if isinstance(value, dict):
        return value
    if isinstance(value, str) and node.inputs is not None and value == node.inputs:
        return {RAW_INPUTS_KEY: value}
    return {"value": value}


def call_output(node: SpanNode) -> Any:
    value = _parse(node.output)
    return None if value is _MISSING else value


def _jsonable(value: Any) -> Any:
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    return value


def exception_info(node: SpanNode) -> dict[str, str] | None:
    """type / message / stacktrace of a failed span (its last ``exception`` event, else its status)."""
    if node.status != "ERROR":
        return None
    events = [e for e in node.events if e.get("name") == sc.EVENT_EXCEPTION]
    attrs = events[-1].get("attributes", {}) if events else {}
    out = {
        "type": str(attrs.get(sc.EXCEPTION_TYPE) or node.attributes.get(sc.ERROR_TYPE) or "Error"),
        "message": str(
            attrs.get(sc.EXCEPTION_MESSAGE)
            if attrs.get(sc.EXCEPTION_MESSAGE) is not None
            else (node.status_message or "")
        ),
    }
    if attrs.get(sc.EXCEPTION_STACKTRACE):
        out["stacktrace"] = str(attrs[sc.EXCEPTION_STACKTRACE])
    return out


_exc_classes: dict[str, type] = {}


def remote_exception(info: dict[str, str]) -> BaseException:
    """An exception object Weave serialises as ``{"type": <original type name>, "message": ...}``."""
    name = info["type"].rsplit(".", 1)[-1] or "Error"
    cls = _exc_classes.get(name)
    if cls is None:
        cls = _exc_classes[name] = type(name, (Exception,), {"__module__": __name__})
    return cls(info["message"])


def trajectory_attributes(t: Trajectory) -> dict[str, Any]:
    """verl's Weave attributes: step, sample_index, rollout_n, experiment_name, validate."""
    out: dict[str, Any] = {}
    if t.step is not None:
        out[sc.TAG_STEP] = t.step
    if t.sample_index is not None:
        out[sc.TAG_SAMPLE_INDEX] = t.sample_index
    if t.rollout_n is not None:
        out[sc.TAG_ROLLOUT_N] = t.rollout_n
    out[sc.TAG_EXPERIMENT_NAME] = t.run.experiment
    out[sc.TAG_VALIDATE] = t.validate
    return out


def call_meta(t: Trajectory, node: SpanNode, is_root: bool) -> dict[str, Any]:
    """The span's OpenTelemetry details, kept under ``attributes["otel_rl"]``."""
    meta: dict[str, Any] = {
        "kind": node.kind,
        "trace_id": f"{t.trace_id:032x}",
        "span_id": f"{node.span_id:016x}",
        "parent_span_id": f"{node.parent_id:016x}" if node.parent_id is not None else None,
        "project": t.run.project,
        "run_id": t.run.run_id,
        "status": node.status,
        "attributes": _jsonable(node.attributes),
    }
    if node.status_message:
        meta["status_message"] = node.status_message
    exc = exception_info(node)
    if exc is not None:
        meta["exception"] = exc
    events = [e for e in node.events if e.get("name") != sc.EVENT_EXCEPTION][:MAX_EVENTS]
    if events:
        meta["events"] = [
            {"name": e.get("name"), "time_ns": e.get("time_ns"), "attributes": _jsonable(e.get("attributes") or {})}
            for e in events
        ]
    if is_root:
        meta["trajectory"] = {"name": t.name, "complete": t.complete}
    return meta


def usage_summary(node: SpanNode) -> dict[str, Any] | None:
    """GenAI token usage as Weave's ``summary.usage[model]`` (summed into parents by Weave)."""
    a = node.attributes
    n_in, n_out = a.get(sc.GEN_AI_USAGE_INPUT_TOKENS), a.get(sc.GEN_AI_USAGE_OUTPUT_TOKENS)
    if n_in is None and n_out is None:
        return None
    model = str(a.get(sc.GEN_AI_RESPONSE_MODEL) or a.get(sc.GEN_AI_REQUEST_MODEL) or "unknown")
    tin, tout = int_or_none(n_in) or 0, int_or_none(n_out) or 0
    return {"usage": {model: {"requests": 1, "input_tokens": tin, "output_tokens": tout, "total_tokens": tin + tout}}}


FALLBACK_OP_NAME = "otel_rl_op"


def op_name(name: str) -> str:
    """The span name as a Weave op name (Weave rejects names with no letter, digit, '_' or '.')."""
    try:
        from weave.trace.weave_client import sanitize_object_name

        sanitize_object_name(name)
    except ValueError:
        return FALLBACK_OP_NAME
    except ImportError:  # pragma: no cover
        pass
    return name


def _require_credentials() -> None:
    """weave.init without W&B credentials would try an interactive login on the export thread."""
    try:
        from weave.wandb_interface.context import get_wandb_auth_context
    except ImportError:  # pragma: no cover - another Weave layout: let weave.init decide
        return
    if get_wandb_auth_context() is None:
        raise RuntimeError(
            "Weave needs W&B credentials: set WANDB_API_KEY (or run `wandb login`), or call "
            "weave.init(project) in the application before otel-rl starts"
        )


# ----------------------------------------------------------------------------- the exporter


class _WeaveRun:
    def __init__(self, ident: RunIdentity, client: Any):
        self.ident = ident
        self.client = client


class WeaveExporter(TrackerExporter):
    """Sampled trajectories -> trees of Weave calls, as verl's Weave rollout tracing makes them.

    A trace backend: it consumes `Trajectory` records whether it is named in
    ``trainer.logger`` or in ``actor_rollout_ref.rollout.trace.backend``; step
    metrics, config and generations are not sent to Weave.
    """

    tracker_name = "weave"
    traces_only_as_backend = False
    # an application usually calls weave.init() itself (often after otel-rl starts), and the
    # exporter logs through that client: it stays in the training process unless asked
    export_process_auto = False

    def __init__(self, config: Any):
        super().__init__(config)
        # Imported here, not at the first trajectory: a first import on the export thread while the
        # interpreter exits fails (concurrent.futures cannot register its exit hook any more).
        import weave  # noqa: F401

        self.wants_trajectories = True
        self._lock = threading.RLock()
        self._clients: dict[str, Any] = {}  # Weave project -> client
        self._extra: list[Any] = []  # clients made here for a second project (finished at shutdown)
        self._done: set[tuple[RunIdentity, int]] = set()  # trajectories of the current batch already sent
        self._flusher: threading.Thread | None = None
        self._closed = False
        self._dirty = False  # calls queued since the last flush
        self._params: dict[str, set[str]] = {}  # create_call / finish_call keyword names

    # -- records ---------------------------------------------------------------------------------
    def export_records(self, records: Sequence[Any]) -> None:
        trajectories = [r for r in records if isinstance(r, Trajectory)]
        if not trajectories:
            return
        with self._lock:
            if self._closed:
                warn_once(
                    "weave-closed",
                    "otel-rl: Weave exporter received %d trajectories after shutdown; not sent",
                    len(trajectories),
                )
                return
            super().export_records(trajectories)

    def open_run(self, run: RunIdentity, start: RunStart | None) -> _WeaveRun:
        return _WeaveRun(run, self._client(run.project))

    def write_trajectories(self, handle: _WeaveRun, trajectories: list[Trajectory]) -> None:
        for t in trajectories:
            key = (t.run, t.trace_id)
            if key in self._done:  # sent before a later one of this batch failed
                continue
            try:
                self.write_trajectory(handle.client, t)
            except OSError:  # network-like (ConnectionError, TimeoutError): the batch is kept and retried
                raise
            except Exception as exc:
                # create_call / finish_call only queue work (the network is Weave's background
                # threads' business), so another error here is about this trajectory's data:
                # retrying the batch would fail the same way.  Skip it, say so once per kind.
                self.reject_record(t, exc)  # one warning naming it, counted in stats()["rejected"]
            self._done.add(key)
            self._dirty = True
        self._done.clear()

    def write_trajectory(self, client: Any, t: Trajectory) -> Any:
        """One trajectory -> its tree of Weave calls; returns the root call."""
        stack = [t.root]  # every time checked first: a bad one refuses the trajectory before any call is made
        while stack:
            node = stack.pop()
            to_datetime(node.start_ns)
            to_datetime(node.end_ns)
            stack.extend(node.children)
        base = trajectory_attributes(t)
        return self._write_node(client, t, t.root, None, base)

    def _write_node(self, client: Any, t: Trajectory, node: SpanNode, parent: Any, base: dict[str, Any]) -> Any:
        is_root = parent is None
        kwargs: dict[str, Any] = {}
        create_params = self._accepts(client, "create_call")
        if "_call_id_override" in create_params:
            kwargs["_call_id_override"] = call_id(t.trace_id, node.span_id, node.start_ns)
        started = to_datetime(node.start_ns)
        if started is not None and "started_at" in create_params:
            kwargs["started_at"] = started
        call = client.create_call(
            op_name(node.name),
            call_inputs(node),
            parent=parent,
            attributes={**base, META_KEY: call_meta(t, node, is_root)},
            display_name=t.name if is_root else node.name,
            use_stack=False,
            **kwargs,
        )
        if type(call).__name__ == "NoOpCall":
            warn_once(
                "weave-disabled",
                "otel-rl: Weave tracing is off in this process (WEAVE_DISABLED, or no Weave "
                "client); trajectories are not sent to Weave",
            )
            return call
        for child in node.children:
            self._write_node(client, t, child, call, base)
        summary = usage_summary(node)
        if summary is not None:
            call.summary = {**(call.summary or {}), **summary}
        info = exception_info(node)
        end_kwargs: dict[str, Any] = {}
        if "ended_at" in self._accepts(client, "finish_call"):
            end_kwargs["ended_at"] = to_datetime(node.end_ns)
        client.finish_call(
            call, output=call_output(node), exception=remote_exception(info) if info is not None else None, **end_kwargs
        )
        return call

    def _accepts(self, client: Any, method: str) -> set[str]:
        """Keyword names of a client method (older Weave versions lack started_at / ended_at / ids)."""
        params = self._params.get(method)
        if params is None:
            try:
                params = set(inspect.signature(getattr(client, method)).parameters)
            except (TypeError, ValueError):  # pragma: no cover
                params = set()
            self._params[method] = params
        return params

    # -- Weave clients ----------------------------------------------------------------------------
    def _client(self, project: str) -> Any:
        client = self._clients.get(project)
        if client is not None:
            return client
        import weave
        from weave.trace.context import weave_client_context

        entity, name = (project.split("/", 1) + [""])[:2] if "/" in project else (None, project)
        current = weave_client_context.get_weave_client()
        if current is not None and current.project == name and (entity is None or current.entity == entity):
            client = current  # the application's (or an earlier init's) client for this project
        elif current is None:
            _require_credentials()
            client = weave.init(project)  # needs W&B credentials and the Weave service
        else:  # a client for another project is the global one: keep it, add one for this project
            from weave.trace.weave_client import WeaveClient

            client = WeaveClient(
                entity or current.entity,
                name,
                current.server,
                ensure_project_exists=getattr(current, "ensure_project_exists", True),
            )
            self._extra.append(client)
        self._clients[project] = client
        return client

    # -- lifecycle --------------------------------------------------------------------------------
    def flush(self, timeout_s: float = 10.0) -> None:
        """Wait (at most `timeout_s`) until Weave has handed the calls to its server or write-ahead log."""
        clients = list({id(c): c for c in self._clients.values()}.values())
        if not clients or not self._dirty:
            return
        self._dirty = False
        if self._flusher is not None and self._flusher.is_alive():
            self._flusher.join(timeout_s)
            return

        def run() -> None:
            for c in clients:
                try:
                    c.flush()
                except Exception as exc:  # pragma: no cover - network errors are Weave's to retry
                    warn_once(f"weave-flush:{type(exc).__name__}", "otel-rl: Weave flush failed: %s", exc)

        self._flusher = threading.Thread(target=run, name="otel-rl-weave-flush", daemon=True)
        self._flusher.start()
        self._flusher.join(timeout_s)

    def shutdown(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            super().shutdown()
        self.flush(30.0)
        for c in self._extra:
            try:
                c.finish(use_progress_bar=False)
            except Exception:  # pragma: no cover
                pass
