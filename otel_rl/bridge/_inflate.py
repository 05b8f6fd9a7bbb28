"""Request bodies inflated in bounded steps, under one memory budget shared by all requests.

A gzip bomb is a small body that inflates to a huge one.  Each body is inflated in steps of
`STEP` bytes and stops at its own limits (``max_decompressed_bytes``, and the inflate ratio for
bodies past 1 MiB), so one bomb costs at most its limit; the `Budget` bounds what all requests
together may hold inflated at once, so many bombs at the same time cost at most the budget.  A
request that would go past the budget is refused with a retryable 503: a sender with real data
retries, and the memory a bomb took is back as soon as its own 413 is sent.
"""

from __future__ import annotations

import threading
import zlib

MIB = 1 << 20
STEP = 256 << 10  # inflated bytes per step: what a request may hold beyond its budget share


class HttpError(Exception):
    """A request refused with an HTTP status (`reason` labels the bridge's request counter)."""

    def __init__(
        self, code: int, reason: str, message: str, close: bool = False, headers: dict[str, str] | None = None
    ):
        super().__init__(message)
        self.code = code
        self.reason = reason
        self.message = message
        self.close = close
        self.headers = headers


class Budget:
    """Bytes that all requests together may hold inflated at once."""

    def __init__(self, limit: int):
        self.limit = limit
        self.used = 0
        self.peak = 0
        self._lock = threading.Lock()

    def lease(self) -> Lease:
        return Lease(self)

    def _take(self, n: int) -> bool:
        with self._lock:
            if self.used + n > self.limit:
                return False
            self.used += n
            if self.used > self.peak:
                self.peak = self.used
            return True

    def _give(self, n: int) -> None:
        with self._lock:
            self.used -= n


class Lease:
    """One request's share of the budget; given back on `close()` (or leaving a ``with`` block)."""

    __slots__ = ("budget", "held")

    def __init__(self, budget: Budget):
        self.budget = budget
        self.held = 0

    def grow(self, n: int) -> bool:
        if not self.budget._take(n):
            return False
        self.held += n
        return True

    def close(self) -> None:
        if self.held:
            self.budget._give(self.held)
            self.held = 0

    def __enter__(self) -> Lease:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def decompress(
    body: bytes, encoding: str, max_out: int, max_ratio: float, lease: Lease | None = None
) -> bytes | bytearray:
    """Inflate `body` (gzip or deflate), never producing more than the limits (and `lease`) allow.

    Returns `body` itself for no encoding, else a bytearray (the decoders take it as it is: no copy).
    """
    enc = encoding.strip().lower()
    if enc in ("", "identity"):
        return body
    if enc in ("gzip", "x-gzip"):
        wbits = 16 + zlib.MAX_WBITS
    elif enc == "deflate":
        wbits = zlib.MAX_WBITS  # RFC 9110 "deflate" is zlib-wrapped; raw deflate is tried below
    else:
        raise HttpError(415, "unsupported_encoding", f"unsupported Content-Encoding {encoding[:40]!r}")
    limit = int(min(max_out, max(MIB, max_ratio * len(body))))
    out = bytearray()
    try:
        return _inflate(body, enc, wbits, limit, max_out, out, lease)
    except HttpError:
        out.clear()  # freed now: the exception's traceback keeps this frame until the answer is sent
        raise


def _inflate(
    body: bytes, enc: str, wbits: int, limit: int, max_out: int, out: bytearray, lease: Lease | None
) -> bytearray:
    data = body
    while True:  # one gzip member (or the one zlib / raw deflate stream) per round
        d = zlib.decompressobj(wbits)
        try:
            while True:
                want = min(STEP, limit - len(out) + 1)
                if lease is not None and not lease.grow(want):
                    raise HttpError(
                        503,
                        "decompression_budget",
                        "too much being decompressed at once; retry",
                        headers={"Retry-After": "1"},
                    )
                chunk = d.decompress(data, want)
                out += chunk
                if len(out) > limit:
                    which = "size" if limit == max_out else "ratio"
                    raise HttpError(413, "decompression_limit", f"body inflates beyond the {which} limit")
                data = d.unconsumed_tail
                if d.eof or (not data and len(chunk) < want):
                    break  # the end of the stream, or of the input (a truncated body, below)
        except zlib.error:
            if enc == "deflate" and wbits == zlib.MAX_WBITS and not out:
                wbits = -zlib.MAX_WBITS
                data = body
                continue
            raise HttpError(400, "bad_compression", f"corrupt {enc} body") from None
        if not d.eof:
            raise HttpError(400, "bad_compression", f"truncated {enc} body")
        data = d.unused_data
        if not data or wbits != 16 + zlib.MAX_WBITS:
            break  # gzip may have several members; anything after a zlib stream is ignored
    return out
