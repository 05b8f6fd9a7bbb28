"""token2text: decode `prompt_ids` / `response_ids` of op outputs off the training thread.

The op wrapper (caller thread) only leaves a job in the op's span (`LightSpan._decode`): a reference to
the tokenizer with a copy of the id lists -- or, when the op's output is a dict copied whole as plain
data (`serialize.snapshot`), the mark `FROM_OUTPUT`: the ids are then read from that copy where they are
decoded (`ids_from_output`), and the training process neither copies nor ships them a second time.
Later the jobs of a whole batch of spans are decoded with one `batch_decode` call per tokenizer
(`decode`), and each op's output JSON gains `prompt_text` / `response_text`.  That happens where the
spans are materialised (`otel_rl._lightspan.materialise`): in the pipeline's thread for what is consumed
in the training process, or in the export process for spans shipped there, with their jobs
(`DecodeJobs.travelling`): the tokenizer travels once, pickled, and the ids travel with their span.
"""

from __future__ import annotations

import json
import logging
import pickle
from typing import Any

from . import semconv as sc
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


def decode(spans: list, max_chars: int) -> None:
    """Decode the token2text jobs of `spans` (light spans; each job leaves its span), one batch per
    tokenizer, and merge the texts into their op outputs (`merge_texts`), in place."""
    by_tok: dict[int, tuple[Any, list]] = {}
    for span in spans:
        entry = span._decode
        if entry is None:
            continue
        span._decode = None
        entry = resolve_entry(entry, span._attributes)
        if entry is not None:
            by_tok.setdefault(id(entry[0]), (entry[0], []))[1].append((span, entry[1], entry[2]))
    for tokenizer, jobs in by_tok.values():
        texts = _decode_pairs(tokenizer, [(p, r) for _span, p, r in jobs])
        for (span, _p, _r), fields in zip(jobs, texts):
            if fields:
                merge_texts(span._attributes, fields, max_chars)


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


class DecodeJobs:
    """The tokenizers of the token2text jobs that travel with shipped spans (`tokenizers`: key ->
    tokenizer, pickled once for the export process)."""

    def __init__(self) -> None:
        self.tokenizers: dict[int, Any] = {}
        # id(tokenizer) -> (tokenizer, key), or key None: it cannot travel and is decoded here (kept with
        # its key, so that its id stays its own)
        self._keys: dict[int, tuple[Any, int | None]] = {}

    def travelling(self, spans: list, remote: Any) -> list[tuple | None] | None:
        """The jobs of `spans` whose tokenizer can travel with them, in order (None for a span without
        one; None for all when there is none): (tokenizer key, prompt ids, response ids), or (tokenizer
        key, `FROM_OUTPUT`).  They leave their spans; the others stay, to be decoded in this process.  A
        tokenizer seen for the first time goes to `remote` (the export process) ahead of the batch that
        needs it."""
        jobs: list[tuple | None] | None = None
        for i, span in enumerate(spans):
            entry = span._decode
            if entry is None:
                continue
            key = self._key(entry[0], remote)
            if key is None:
                continue
            span._decode = None
            if jobs is None:
                jobs = [None] * len(spans)
            if len(entry) == 2:  # (tokenizer, FROM_OUTPUT): the ids travel in the op's output copy
                jobs[i] = (key, entry[1])
                continue
            _tok, p, r = entry
            try:
                jobs[i] = (key, None if p is None else _as_list(p), None if r is None else _as_list(r))
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
