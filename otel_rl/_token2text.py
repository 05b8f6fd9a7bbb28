"""token2text: decode `prompt_ids` / `response_ids` of op outputs off the training thread.

The op wrapper (caller thread) only stores a reference to the tokenizer in
`pending[span_id]`, with a copy of the id lists -- or, when the op's output is a
dict copied whole as plain data (`serialize.snapshot`), the mark `FROM_OUTPUT`:
the ids are then read from that copy where they are decoded (`ids_from_output`),
and the training process neither copies nor ships them a second time.  Later
the ids of a whole batch are decoded with one `batch_decode` call per
tokenizer, and the op's output JSON gains `prompt_text` / `response_text`.
That happens in the pipeline's thread (`decode_fields`) for what is consumed in
the training process, or, for spans shipped packed to the export process, there
(`decode_packed`): the tokenizer travels once, pickled, and the ids travel with
their span.
"""

from __future__ import annotations

import json
import logging
import pickle
from typing import Any

from opentelemetry.sdk.trace import ReadableSpan

from . import semconv as sc
from ._lightspan import CONTEXT_IS_TUPLE, LightSpan
from ._values import warn_once
from .serialize import _dumps, materialize, to_json

_log = logging.getLogger("otel_rl")


#: a pending entry's second item when the ids are to be read from the op's output copy (an entry is then
#: ``(tokenizer, FROM_OUTPUT)``; a shipped job ``(tokenizer key, FROM_OUTPUT)``)
FROM_OUTPUT = "output"
#: the mark is used only for output copies this many times smaller than `max_chars`: the JSON text made of
#: such a copy is never cut (a plain value's JSON is at most ~6 times the size of its pickle), so its ids
#: can always be read back from that text too (`ids_from_output`)
_COPY_TO_TEXT = 8


def raw_ids(output: Any) -> tuple[Any, Any] | None:
    """(prompt_ids, response_ids) of a dict or an object, as they are (not copied), or None."""
    if isinstance(output, dict):
        p, r = output.get(sc.PROMPT_IDS), output.get(sc.RESPONSE_IDS)
    else:
        p, r = getattr(output, sc.PROMPT_IDS, None), getattr(output, sc.RESPONSE_IDS, None)
    if p is None and r is None:
        return None
    return p, r


def pending_entry(tokenizer: Any, output: Any, copy: Any, max_chars: int, ids: tuple | None) -> tuple | None:
    """What `pending[span_id]` holds for an op with `output` whose attribute is `copy` (`serialize.snapshot`);
    `ids`: `raw_ids(output)` when known.  None when the output has no ids."""
    if type(copy) is bytes and type(output) is dict and len(copy) * _COPY_TO_TEXT <= max_chars:
        if sc.PROMPT_IDS in output or sc.RESPONSE_IDS in output:
            return (tokenizer, FROM_OUTPUT)  # the copy holds them as they are now
        return None
    if ids is None:
        ids = raw_ids(output)
    if ids is None:
        return None
    return (tokenizer, _snapshot(ids[0]), _snapshot(ids[1]))


def ids_from_output(value: Any) -> tuple[Any, Any] | None:
    """(prompt_ids, response_ids) read back from an op output attribute: the copy (bytes) or its JSON
    text (a whole object); None when it holds none or cannot be read."""
    try:
        obj = pickle.loads(value) if type(value) is bytes else json.loads(value) if isinstance(value, str) else None
    except Exception:
        return None
    return raw_ids(obj) if isinstance(obj, dict) else None


def resolve_entry(entry: tuple, attributes: Any) -> tuple | None:
    """A pending entry with its ids: `entry` itself, or for a `FROM_OUTPUT` one the ids read from the op's
    output in `attributes` ((tokenizer, prompt ids, response ids); None when they cannot be read)."""
    if len(entry) != 2:
        return entry
    ids = ids_from_output((attributes or {}).get(sc.RL_OP_OUTPUT))
    return None if ids is None else (entry[0], *ids)


def _snapshot(ids: Any) -> Any:
    if ids is None:
        return None
    if isinstance(ids, list):
        return list(ids)  # the caller may keep appending to its list
    return ids  # tensors / arrays / tuples: converted in the export thread


def _as_list(ids: Any) -> list[int]:
    if hasattr(ids, "tolist"):
        ids = ids.tolist()
    return [int(i) for i in ids]


def _decode_all(tokenizer: Any, seqs: list[list[int]]) -> list[str]:
    batch = getattr(tokenizer, "batch_decode", None)
    if callable(batch):
        try:
            return list(batch(seqs, skip_special_tokens=True))
        except TypeError:
            return list(batch(seqs))
    return [str(tokenizer.decode(s)) for s in seqs]


def _span_id(span: Any) -> int:
    if type(span) is LightSpan:
        return span._context[1] if CONTEXT_IS_TUPLE else span._context.span_id
    return span.context.span_id


def span_ids(spans: list) -> list[int]:
    """The span id of each span (light or SDK), in order."""
    return [_span_id(s) for s in spans]


def decode_fields(spans: list, pending: dict[int, tuple], sids: list[int] | None = None) -> dict[int, dict[str, str]]:
    """Decode the ids noted for `spans` (their entries leave `pending`): span id -> the text fields.
    `sids`: the spans' ids, when the caller has them already."""
    jobs = []  # (span id, tokenizer, prompt_ids, response_ids)
    for span, sid in zip(spans, span_ids(spans) if sids is None else sids):
        entry = pending.pop(sid, None)
        if entry is not None:
            entry = resolve_entry(entry, span._attributes if type(span) is LightSpan else span.attributes)
            if entry is not None:
                jobs.append((sid, *entry))
    if not jobs:
        return {}
    by_tok: dict[int, tuple[Any, list]] = {}
    for job in jobs:
        by_tok.setdefault(id(job[1]), (job[1], []))[1].append(job)
    decoded: dict[int, dict[str, str]] = {}
    for tokenizer, tok_jobs in by_tok.values():
        texts = _decode_pairs(tokenizer, [(p, r) for _sid, _tok, p, r in tok_jobs])
        for (sid, *_), fields in zip(tok_jobs, texts):
            if fields:
                decoded[sid] = fields
    return decoded


def _decode_pairs(tokenizer: Any, pairs: list[tuple[Any, Any]]) -> list[dict[str, str]]:
    """The text fields of each (prompt ids, response ids) pair, in one batch; all empty when it fails."""
    seqs, where = [], []
    for k, (p, r) in enumerate(pairs):
        for field, ids in ((sc.PROMPT_TEXT, p), (sc.RESPONSE_TEXT, r)):
            if ids is not None:
                try:
                    seqs.append(_as_list(ids))
                    where.append((k, field))
                except Exception:
                    pass
    out: list[dict[str, str]] = [{} for _ in pairs]
    try:
        texts = _decode_all(tokenizer, seqs) if seqs else []
    except Exception as exc:
        warn_once(
            f"token2text:{type(exc).__name__}", "otel-rl: token2text decoding failed (%s: %s)", type(exc).__name__, exc
        )
        return out
    for (k, field), text in zip(where, texts):
        out[k][field] = text
    return out


def decode_packed(packed: list, tokenizers: dict[int, Any], max_chars: int) -> None:
    """Packed spans (`otel_rl._wire`) that carry ids to decode (an 11th item: tokenizer key, prompt
    ids, response ids; or tokenizer key, `FROM_OUTPUT`: the ids are in the op's output): decode them,
    one batch per tokenizer, and merge the texts into their attributes, in place.  A key without a
    tokenizer (it could not be loaded here) loses its texts."""
    resolve_packed(packed)
    by_key: dict[int, list] = {}
    for t in packed:
        if len(t) > 10 and t[10] is not None and len(t[10]) == 3:
            by_key.setdefault(t[10][0], []).append(t)
    for key, spans in by_key.items():
        tokenizer = tokenizers.get(key)
        if tokenizer is None:
            warn_once(
                f"token2text-missing:{key}",
                "otel-rl: token2text: a tokenizer could not be loaded in the "
                "export process; %d outputs keep their ids only",
                len(spans),
            )
            continue
        for t, fields in zip(spans, _decode_pairs(tokenizer, [t[10][1:] for t in spans])):
            if fields:
                merge_texts(t[6], fields, max_chars)


def resolve_packed(packed: list) -> None:
    """The `FROM_OUTPUT` jobs of packed spans with their ids, read from the op's output (in place; a job
    whose ids cannot be read is dropped).  Before the outputs' copies are made into text
    (`serialize.materialize`, as `decode_packed` is called), the ids are exactly the ones the op returned."""
    for i, t in enumerate(packed):
        if len(t) > 10 and t[10] is not None and len(t[10]) == 2:
            ids = ids_from_output(t[6].get(sc.RL_OP_OUTPUT))
            packed[i] = (*t[:10], None if ids is None else (t[10][0], *ids))


def drop(spans: list, pending: dict[int, tuple], sids: list[int] | None = None) -> None:
    """Forget the ids noted for `spans` (nobody takes their texts)."""
    for sid in span_ids(spans) if sids is None else sids:
        pending.pop(sid, None)


def decode_spans(spans: list, pending: dict[int, tuple], max_chars: int) -> list:
    """`spans` (SDK spans) with the decoded texts merged into their op outputs."""
    decoded = decode_fields(spans, pending)
    if not decoded:
        return spans
    return [with_texts(s, decoded[s.context.span_id], max_chars) if s.context.span_id in decoded else s for s in spans]


def _spliced(raw: str, fields: dict[str, str], max_chars: int) -> str | None:
    """The output object's JSON text with `fields` added at its end, without parsing it: what
    ``to_json({**json.loads(raw), **fields})`` gives when `raw` is a whole JSON object without those
    keys (our encoder wrote it; separators ", " and ": ").  None when that cannot be told cheaply."""
    if len(raw) < 2 or raw[0] != "{" or raw[-1] != "}" or any(f'"{k}"' in raw for k in fields):
        return None
    parts = [f"{_dumps(k)}: {_dumps(v)}" for k, v in fields.items()]
    text = raw[:-1] + (", " if raw != "{}" else "") + ", ".join(parts) + "}"
    return text if len(text) <= max_chars else None


def merge_texts(attrs: dict, fields: dict[str, str], max_chars: int) -> None:
    """Put the decoded `fields` into a span's attributes (in place): into its op output object when
    that is a whole JSON object, else as attributes of their own."""
    raw = materialize(attrs, max_chars).get(sc.RL_OP_OUTPUT)
    if isinstance(raw, str) and not attrs.get(sc.RL_TRUNCATED):
        spliced = _spliced(raw, fields, max_chars)
        if spliced is not None:
            attrs[sc.RL_OP_OUTPUT] = spliced
            return
    if isinstance(raw, str):
        try:
            obj = json.loads(raw)
        except ValueError:
            obj = None
        if isinstance(obj, dict):
            obj.update(fields)
            text, truncated = to_json(obj, max_chars)
            attrs[sc.RL_OP_OUTPUT] = text
            if truncated:
                attrs[sc.RL_TRUNCATED] = True
            return
    for k, v in fields.items():
        attrs[k] = v[:max_chars]


def with_texts(span: ReadableSpan, fields: dict[str, str], max_chars: int) -> ReadableSpan:
    attrs = dict(span.attributes or {})
    merge_texts(attrs, fields, max_chars)
    return ReadableSpan(
        span.name,
        context=span.context,
        parent=span.parent,
        resource=span.resource,
        attributes=attrs,
        events=span.events,
        links=span.links,
        kind=span.kind,
        status=span.status,
        start_time=span.start_time,
        end_time=span.end_time,
        instrumentation_scope=span.instrumentation_scope,
    )


class DecodeJobs:
    """The token2text jobs the op wrapper leaves for the pipeline (`pending`: span id -> entry, see
    `pending_entry`), and the tokenizers that travel with shipped spans (`tokenizers`: key -> tokenizer,
    pickled once for the export process)."""

    def __init__(self) -> None:
        self.pending: dict[int, tuple] = {}
        self.tokenizers: dict[int, Any] = {}
        # id(tokenizer) -> (tokenizer, key), or key None: it cannot travel and is decoded here (kept with
        # its key, so that its id stays its own)
        self._keys: dict[int, tuple[Any, int | None]] = {}

    def add(self, span: Any, entry: tuple) -> None:
        """The op wrapper (training thread): `span`'s output has ids to decode."""
        self.pending[_span_id(span)] = entry

    def travelling(self, sids: list[int], remote: Any) -> dict[int, tuple]:
        """The jobs of the spans `sids` whose tokenizer can travel with them, as span id -> (tokenizer key,
        prompt ids, response ids); they leave `pending`.  The others stay for this process.  A tokenizer
        seen for the first time goes to `remote` (the export process) ahead of the batch that needs it."""
        pending = self.pending
        jobs: dict[int, tuple] = {}
        for sid in sids:
            entry = pending.get(sid)
            if entry is None:
                continue
            key = self._key(entry[0], remote)
            if key is None:
                continue
            del pending[sid]
            if len(entry) == 2:  # (tokenizer, FROM_OUTPUT): the ids travel in the op's output copy
                jobs[sid] = (key, entry[1])
                continue
            tok, p, r = entry
            try:
                jobs[sid] = (key, None if p is None else _as_list(p), None if r is None else _as_list(r))
            except Exception:  # ids that are not a sequence of ints: nothing to decode
                pass
        return jobs

    def _key(self, tokenizer: Any, remote: Any) -> int | None:
        known = self._keys.get(id(tokenizer))
        if known is not None:
            return known[1]
        key = None
        try:
            blob = pickle.dumps(tokenizer, protocol=pickle.HIGHEST_PROTOCOL)
        except Exception:
            blob = None  # it stays: decoded in this process
        if blob is not None:
            key = len(self._keys) + 1
            self.tokenizers[key] = tokenizer
            if remote is not None:
                remote.send_tokenizer(key, blob)  # ahead of the batch that first needs it
        self._keys[id(tokenizer)] = (tokenizer, key)
        return key
