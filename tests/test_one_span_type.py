"""One span type: every span otel-rl makes is the SDK's `ReadableSpan` (a light span), from the decorator
to the span processors, the exporters and the record builder, in the training process and behind the
export process's wire.

- A user's span processor sees every kind of span otel-rl makes start and end -- the run, a step, its
  timer, a trajectory, its ops, `rl.log` and `rl.generations` -- as one object of one type, materialised
  (an op's inputs and output as JSON text, token2text's texts in) when `on_end` is called.
- The records built behind the wire (spans packed with their copies and token2text jobs, unpacked and
  materialised where the trajectories are built, as in the export process) equal the records built
  in-process from the same workload.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any

from opentelemetry import trace as trace_api
from opentelemetry.sdk.trace import ReadableSpan, SpanProcessor, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

import otel_rl
from otel_rl import semconv as sc
from otel_rl.records import SpanNode, Trajectory
from otel_rl.testing import CaptureExporter


class LetterTokenizer:
    """ids -> letters (0 -> 'a')."""

    def __init__(self) -> None:
        self.calls = 0

    def batch_decode(self, seqs: list, skip_special_tokens: bool = False) -> list[str]:
        self.calls += 1
        return ["".join(chr(ord("a") + i) for i in s) for s in seqs]


@dataclasses.dataclass
class Ids:
    prompt_ids: list
    response_ids: list


@otel_rl.op
def plan(task: dict) -> dict:
    return {"steps": [task["goal"], "check"], "n": 2}


@otel_rl.generate(model="policy")
def chat(prompt_ids: list) -> dict:
    return {"prompt_ids": list(prompt_ids), "response_ids": [7, 8], "text": "x = 4"}


@otel_rl.generate(model="policy")
def chat_obj(prompt_ids: list) -> Ids:
    return Ids(list(prompt_ids), [9])


@otel_rl.tool(name="calculator")
def calculator(expression: str) -> int:
    if expression == "bad":
        raise ValueError("cannot parse")
    return 4


def workload(steps: int = 2, samples: int = 2) -> None:
    for step in range(1, steps + 1):
        with otel_rl.step(step):
            with otel_rl.timer("gen"):
                for i in range(samples):
                    with otel_rl.trajectory(sample_index=i, rollout_n=0) as t:
                        plan({"goal": f"task {step}.{i}", "ids": [step, i]})
                        chat([i, step])
                        chat_obj([step])
                        calculator("2+2")
                        try:
                            calculator("bad")
                        except ValueError:
                            pass
                        t.set_reward(0.5 * i)
            otel_rl.log({"loss": 1.0 / step, "n": step}, step=step)
            otel_rl.log_generations([("q", "a", 1.0)], step=step)


# ----------------------------------------------------------------------------- span processors


class Seen(SpanProcessor):
    """A user's processor: each span it saw start; each it saw end, with the types of its op values then."""

    def __init__(self) -> None:
        self.started: list[Any] = []
        self.ended: list[tuple[Any, dict[str, type], dict[str, Any]]] = []

    def on_start(self, span: Any, parent_context: Any = None) -> None:
        self.started.append(span)

    def on_end(self, span: ReadableSpan) -> None:
        attrs = dict(span.attributes)
        self.ended.append((span, {k: type(v) for k, v in attrs.items()}, attrs))


def test_a_users_processor_sees_every_kind_of_span_start_and_end_as_one_materialised_readable_span(monkeypatch):
    """Processors on a global SDK provider set before init() (they see the run span too) and on otel-rl's
    own provider: each sees every span otel-rl makes start and end, the same object at both, of one type
    (the SDK's `ReadableSpan`), with the ops' inputs and outputs JSON text (never a copy as bytes) and
    token2text's texts in when `on_end` is called; an SDK exporter behind the global provider gets them."""
    exported = InMemorySpanExporter()
    glob = Seen()
    provider = TracerProvider()
    provider.add_span_processor(glob)
    provider.add_span_processor(SimpleSpanProcessor(exported))
    monkeypatch.setattr(trace_api, "get_tracer_provider", lambda: provider)
    tok = LetterTokenizer()
    h = otel_rl.init(exporters=["console"], batch_delay_s=0.05, token2text=True, tokenizer=tok)
    own = Seen()
    try:
        assert h.flush(30)  # the run span is handled: `own` comes after it, as a processor added mid-run does
        h.tracer_provider.add_span_processor(own)
        workload(steps=2, samples=2)
        assert h.flush(30)
    finally:
        h.shutdown()

    for seen in (glob, own):
        started = {id(s): s for s in seen.started}
        ended = {id(s): s for s, _, _ in seen.ended}
        assert started.keys() == ended.keys() and len(ended) == len(seen.ended)  # each once, the same object
        assert {type(s) for s in ended.values()} == {type(seen.started[0])}
        assert all(isinstance(s, ReadableSpan) and not s.is_recording() for s in ended.values())
        names = [s.name for s in ended.values()]
        for name, n in ((sc.SPAN_STEP, 2), ("gen", 2), (sc.SPAN_TRAJECTORY, 4), ("plan", 4),
                        ("chat policy", 8), ("execute_tool calculator", 8), (sc.SPAN_LOG, 4),
                        (sc.SPAN_GENERATIONS, 2)):
            assert names.count(name) == n, (name, names)
        ops = [(s, types, attrs) for s, types, attrs in seen.ended if sc.RL_OP_INPUTS in types]
        assert len(ops) == 20
        for s, types, attrs in ops:
            assert types[sc.RL_OP_INPUTS] is str and types.get(sc.RL_OP_OUTPUT, str) is str, (s.name, types)
            json.loads(attrs[sc.RL_OP_INPUTS])
            json.dumps(json.loads(s.to_json()))  # the SDK's own code reads it
        chats = [json.loads(a[sc.RL_OP_OUTPUT]) for s, _, a in ops if s.name == "chat policy" and
                 isinstance(json.loads(a[sc.RL_OP_OUTPUT]), dict)]
        assert sorted(c[sc.PROMPT_TEXT] + "|" + c[sc.RESPONSE_TEXT] for c in chats) == sorted([
            "ab|hi", "ac|hi", "b|j", "b|j", "bb|hi", "bc|hi", "c|j", "c|j"])
        log = [a for s, _, a in seen.ended if s.name == sc.SPAN_LOG and "loss" in a[sc.RL_METRICS_KEYS]]
        assert sorted(a[sc.RL_STEP] for a in log) == [1, 2]
    assert [s for s in glob.ended if s[0].name == sc.SPAN_RUN] and not [s for s in own.ended
                                                                        if s[0].name == sc.SPAN_RUN]
    assert {id(s) for s in exported.get_finished_spans()} == {id(s) for s, _, _ in glob.ended}


# ----------------------------------------------------------------------------- behind the wire


class TrajectoriesOnly(CaptureExporter):
    """Keeps the records; takes no spans and reads no metric instrument (nothing else needs spans here)."""

    wants_spans = False

    def metric_readers(self) -> list[Any]:
        return []


class RecordsOnly(TrajectoriesOnly):
    wants_trajectories = False


def _tree(n: SpanNode) -> tuple:
    return (n.name, n.kind, sorted(n.attributes.items()), n.inputs, n.output, n.status, n.status_message,
            [(e["name"], sorted(e["attributes"].items())) for e in n.events], [_tree(c) for c in n.children])


def _shape(t: Trajectory) -> tuple:
    """A trajectory without the ids and times that differ between two runs."""
    return (t.name, t.step, t.sample_index, t.rollout_n, t.validate, t.complete, t.tags(), _tree(t.root))


def _run(through_wire: bool) -> tuple[list[tuple], list[tuple]]:
    """The workload's trajectories (as `_shape`), and what the wire carried (op values' types and jobs)."""
    tok = LetterTokenizer()
    cap = TrajectoriesOnly()
    carried: list[tuple] = []
    h = otel_rl.init(exporters=[RecordsOnly()] if through_wire else [cap], tracing=True, batch_delay_s=0.05,
                     token2text=True, tokenizer=tok, feed_global_provider=False)
    try:
        if through_wire:
            # the queues that take over from an export process: the spans reach them packed, and their
            # `Receiver` unpacks, materialises and builds the trajectories, as the export process does
            receiver = h._pipeline.adopt(None, [cap])
            put = receiver.put

            def noting(records: list, names: Any, wire: Any = None, *args: Any) -> None:
                for t in wire or ():
                    carried.append((type(t[6].get(sc.RL_OP_INPUTS)), t[10] if len(t) > 10 else None))
                put(records, names, wire, *args)

            receiver.put = noting
        workload(steps=2, samples=2)
        assert h.flush(30)
    finally:
        h.shutdown()
    assert tok.calls >= 1
    return sorted((_shape(t) for t in cap.trajectories()), key=repr), carried


def test_records_built_behind_the_wire_equal_those_built_in_process():
    local, none_carried = _run(through_wire=False)
    remote, carried = _run(through_wire=True)
    assert none_carried == []
    assert len(local) == 4
    assert remote == local
    # what travelled was the light spans' deferred work itself, done on the receiving side
    assert bytes in {kind for kind, _ in carried}
    assert sum(1 for _, job in carried if job is not None) == 8  # one token2text job per chat call


def test_a_processor_that_fails_on_start_or_end_never_reaches_the_training_code(caplog):
    """A user's processor raising in `on_start` (on the training thread) and `on_end` (on the pipeline's):
    logged, the training code and the other consumers go on."""

    class Failing(SpanProcessor):
        def on_start(self, span: Any, parent_context: Any = None) -> None:
            raise RuntimeError("on_start fails")

        def on_end(self, span: ReadableSpan) -> None:
            raise RuntimeError("on_end fails")

    cap = CaptureExporter()
    h = otel_rl.init(exporters=[cap], batch_delay_s=0.05, feed_global_provider=False)
    cap.handle = h
    try:
        h.tracer_provider.add_span_processor(Failing())
        workload(steps=1, samples=1)
        assert h.flush(30)
        assert len(cap.trajectories()) == 1 and cap.metrics_by_step()[1]["loss"] == 1.0
    finally:
        h.shutdown()
    assert "on_start failed" in caplog.text and "on_end failed" in caplog.text
