"""Reach an endpoint step by step (DNS, TCP, proxy, TLS, HTTP) and name the step that failed.

`probe` never raises and never waits longer than its timeout per step: each failure kind gets its
own cause and fix, which is what `otel-rl doctor` prints.  Proxies are HTTP proxies as
``HTTPS_PROXY`` / ``HTTP_PROXY`` / ``NO_PROXY`` (and verl's ``trainer.wandb_proxy``) name them: an
``https`` URL goes through ``CONNECT``, an ``http`` one as an absolute-URI request.
"""

from __future__ import annotations

import base64
import concurrent.futures
import dataclasses
import errno
import http.client
import os
import socket
import ssl
import threading
import time
import urllib.parse
from typing import Any


@dataclasses.dataclass
class Probe:
    """What reaching one URL gave: ``ok``, or the failed ``stage`` with its cause and fix."""

    url: str
    ok: bool
    stage: str = ""  # dns | tcp | proxy | tls | http
    cause: str = ""
    fix: str = ""
    status: int | None = None
    body: bytes = b""
    via: str = ""  # the proxy, with any password removed
    seconds: float = 0.0


def redact_url(url: str) -> str:
    """The URL without a password (``user:***@``) and without query values."""
    try:
        p = urllib.parse.urlsplit(url)
    except ValueError:
        return "<unparsable URL>"
    if p.password is None and not p.query:
        return url  # nothing to hide; rebuilt, ``sqlite:////abs/path`` would lose a slash
    netloc = p.netloc
    if p.password is not None:
        netloc = f"{p.username}:***@{p.hostname}" + (f":{p.port}" if p.port else "")
    query = "&".join(f"{k}=***" for k, _ in urllib.parse.parse_qsl(p.query, keep_blank_values=True))
    return urllib.parse.urlunsplit((p.scheme, netloc, p.path, query, ""))


def proxy_for(url: str, explicit: str | None = None, env: Any = None) -> str | None:
    """The proxy a client would use for `url`: `explicit`, else the ``*_PROXY`` variables unless
    ``NO_PROXY`` covers the host."""
    env = os.environ if env is None else env
    if explicit:
        return explicit
    p = urllib.parse.urlsplit(url)
    host = (p.hostname or "").lower()
    no_proxy = env.get("NO_PROXY") or env.get("no_proxy") or ""
    for entry in (e.strip().lower() for e in no_proxy.split(",")):
        if entry == "*" or (entry and (host == entry.lstrip(".") or host.endswith("." + entry.lstrip(".")))):
            return None
    names = ("HTTPS_PROXY", "https_proxy") if p.scheme == "https" else ("HTTP_PROXY", "http_proxy")
    for name in names + ("ALL_PROXY", "all_proxy"):
        if env.get(name):
            return env[name]
    return None


def _resolve(host: str, port: int, timeout: float) -> list[Any]:
    """`socket.getaddrinfo`, waited for at most `timeout` seconds.

    getaddrinfo has no timeout of its own (with a resolver that does not answer, glibc tries for 10 s and
    more); it runs in a daemon thread, which the process does not wait for when it ends."""
    done = threading.Event()
    box: list[Any] = []

    def work() -> None:
        try:
            box.append(socket.getaddrinfo(host, port, 0, socket.SOCK_STREAM))
        except BaseException as exc:  # handed to the caller
            box.append(exc)
        finally:
            done.set()

    threading.Thread(target=work, name="otel-rl-doctor-dns", daemon=True).start()
    if not done.wait(timeout):
        raise concurrent.futures.TimeoutError
    if isinstance(box[0], BaseException):
        raise box[0]
    return box[0]


def _connect(host: str, port: int, timeout: float, what: str) -> tuple[socket.socket | None, str, str, str]:
    """(socket, stage, cause, fix); the socket is None on failure."""
    try:
        infos = _resolve(host, port, timeout)
    except concurrent.futures.TimeoutError:
        return (
            None,
            "dns",
            f"DNS: no answer for {host} within {timeout:g} s",
            "check /etc/resolv.conf or use the proxy your network requires",
        )
    except socket.gaierror as exc:
        return (
            None,
            "dns",
            f"DNS: cannot resolve {host} ({exc.strerror})",
            f"check the {what} host name; behind a firewall, set HTTPS_PROXY",
        )
    except UnicodeError:
        return None, "dns", f"DNS: {host!r} is not a valid host name", f"correct the {what} host name"
    last: tuple[str, str] = ("", "")
    for family, kind, proto, _, addr in infos:
        s = socket.socket(family, kind, proto)
        s.settimeout(timeout)
        try:
            s.connect(addr)
            return s, "", "", ""
        except TimeoutError:
            last = (
                f"TCP: connection to {host}:{port} timed out after {timeout:g} s (a firewall drops the "
                "packets, or the host is down)",
                f"check the firewall rules for port {port}, or the proxy",
            )
        except ConnectionRefusedError:
            last = (
                f"TCP: connection to {host}:{port} refused (nothing listens there)",
                f"start the {what} or correct the port",
            )
        except OSError as exc:
            if exc.errno in (errno.ENETUNREACH, errno.EHOSTUNREACH):
                last = (f"TCP: {host}:{port} unreachable ({exc.strerror})", "check the network route or the proxy")
            else:
                last = (f"TCP: cannot connect to {host}:{port} ({exc.strerror or exc})", "check the address")
        s.close()
    return None, "tcp", last[0], last[1]


def _recv_head(s: socket.socket) -> bytes:
    data = b""
    while b"\r\n\r\n" not in data and len(data) < 65536:
        chunk = s.recv(4096)
        if not chunk:
            break
        data += chunk
    return data


def probe(
    url: str,
    *,
    method: str = "GET",
    path: str = "",
    headers: dict[str, str] | None = None,
    body: bytes | None = None,
    proxy: str | None = None,
    timeout: float = 3.0,
    what: str = "server",
    cafile: str | None = None,
) -> Probe:
    """Reach ``url + path`` and send one request; the first step that fails names the cause."""
    t0 = time.monotonic()
    res = _probe(url, method, path, headers or {}, body, proxy, timeout, what, cafile)
    res.seconds = time.monotonic() - t0
    return res


def _probe(
    url: str,
    method: str,
    path: str,
    headers: dict[str, str],
    body: bytes | None,
    proxy: str | None,
    timeout: float,
    what: str,
    cafile: str | None,
) -> Probe:
    shown = redact_url(url)
    try:
        p = urllib.parse.urlsplit(url)
        port = p.port or (443 if p.scheme == "https" else 80)
    except ValueError as exc:
        return Probe(shown, False, "url", f"not a URL ({exc})", "correct the URL")
    if p.scheme not in ("http", "https") or not p.hostname:
        return Probe(shown, False, "url", f"not an http(s) URL: {shown}", "give a URL like https://host:port")
    host = p.hostname
    target = (p.path.rstrip("/") + path) or "/"
    if p.query:
        target += "?" + p.query
    via = redact_url(proxy) if proxy else ""
    if proxy:
        pp = urllib.parse.urlsplit(proxy if "://" in proxy else "http://" + proxy)
        if not pp.hostname:
            return Probe(
                shown, False, "proxy", f"proxy setting is not a URL: {via}", "set it like http://host:3128", via=via
            )
        s, stage, cause, fix = _connect(pp.hostname, pp.port or 3128, timeout, "proxy")
        if s is None:
            return Probe(
                shown,
                False,
                "proxy",
                f"proxy {via}: {cause}",
                "check the proxy address (HTTPS_PROXY, trainer.wandb_proxy) or unset it",
                via=via,
            )
        auth = {}
        if pp.username:
            token = base64.b64encode(
                f"{urllib.parse.unquote(pp.username)}:{urllib.parse.unquote(pp.password or '')}".encode()
            ).decode()
            auth["Proxy-Authorization"] = f"Basic {token}"
        if p.scheme == "https":
            lines = [f"CONNECT {host}:{port} HTTP/1.1", f"Host: {host}:{port}"] + [f"{k}: {v}" for k, v in auth.items()]
            try:
                s.sendall(("\r\n".join(lines) + "\r\n\r\n").encode())
                head = _recv_head(s)
            except TimeoutError:
                s.close()
                return Probe(
                    shown,
                    False,
                    "proxy",
                    f"proxy {via} did not answer CONNECT within {timeout:g} s",
                    "check the proxy",
                    via=via,
                )
            except OSError as exc:
                s.close()
                return Probe(
                    shown, False, "proxy", f"proxy {via} closed the connection ({exc})", "check the proxy", via=via
                )
            code = _status_of(head)
            if code != 200:
                s.close()
                why = (
                    "needs credentials (407)"
                    if code == 407
                    else (f"refused the tunnel to {host}:{port} ({_status_line(head) or 'no answer'})")
                )
                return Probe(
                    shown,
                    False,
                    "proxy",
                    f"proxy {via} {why}",
                    "put user:password in the proxy URL"
                    if code == 407
                    else f"ask for {host}:{port} to be allowed through the proxy, or set NO_PROXY={host}",
                    status=code,
                    via=via,
                )
            absolute = None
        else:
            headers = {**headers, **auth}
            absolute = urllib.parse.urlunsplit((p.scheme, p.netloc.rpartition("@")[2], target, "", ""))
    else:
        s, stage, cause, fix = _connect(host, port, timeout, what)
        if s is None:
            return Probe(shown, False, stage, cause, fix)
        absolute = None
    if p.scheme == "https":
        ctx = ssl.create_default_context(
            cafile=cafile or os.environ.get("REQUESTS_CA_BUNDLE") or os.environ.get("SSL_CERT_FILE") or None
        )
        try:
            s = ctx.wrap_socket(s, server_hostname=host)
        except ssl.SSLCertVerificationError as exc:
            s.close()
            return Probe(
                shown,
                False,
                "tls",
                f"TLS: certificate of {host} not trusted ({exc.verify_message})",
                "set REQUESTS_CA_BUNDLE / SSL_CERT_FILE to your CA bundle",
                via=via,
            )
        except TimeoutError:
            s.close()
            return Probe(
                shown,
                False,
                "tls",
                f"TLS: no handshake answer from {host}:{port} within {timeout:g} s",
                "check that the port serves HTTPS",
                via=via,
            )
        except (ssl.SSLError, OSError) as exc:
            s.close()
            return Probe(
                shown,
                False,
                "tls",
                f"TLS handshake with {host}:{port} failed ({exc}); is it plain HTTP?",
                "use http:// if the server has no TLS, or check its certificate",
                via=via,
            )
    # the socket's timeout bounds each read, not the answer: one that trickles in is cut off at `timeout`
    cut = threading.Event()

    def cut_off() -> None:
        cut.set()
        try:
            s.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass

    watchdog = threading.Timer(timeout, cut_off)
    watchdog.daemon = True
    watchdog.start()
    try:
        conn = http.client.HTTPConnection(host, port, timeout=timeout)
        conn.sock = s
        conn.putrequest(method, absolute or target, skip_accept_encoding=True)
        for k, v in headers.items():
            conn.putheader(k, v)
        if body is not None:
            conn.putheader("Content-Length", str(len(body)))
        conn.endheaders(body)
        resp = conn.getresponse()
        data = resp.read(65536)
        conn.close()
        if cut.is_set():
            raise TimeoutError
    except TimeoutError:
        s.close()
        return _no_answer(shown, host, port, timeout, what, via)
    except (http.client.HTTPException, OSError) as exc:
        s.close()
        if cut.is_set():
            return _no_answer(shown, host, port, timeout, what, via)
        return Probe(
            shown,
            False,
            "http",
            f"HTTP: {host}:{port} closed the connection or answered garbage ({type(exc).__name__}: {exc})",
            f"check that port {port} serves HTTP(S) for the {what}",
            via=via,
        )
    finally:
        watchdog.cancel()
    code = resp.status
    res = Probe(shown, 200 <= code < 300, "http", status=code, body=data, via=via)
    if not res.ok:
        res.cause, res.fix = http_cause(code, what)
    return res


def _no_answer(shown: str, host: str, port: int, timeout: float, what: str, via: str) -> Probe:
    return Probe(
        shown,
        False,
        "http",
        f"HTTP: connected to {host}:{port} but no answer within {timeout:g} s "
        "(the service hangs or trickles its answer, or something in the way holds the connection)",
        f"check that the {what} is healthy; restart it",
        via=via,
    )


def http_cause(code: int, what: str) -> tuple[str, str]:
    if code in (401, 403):
        return (
            f"HTTP {code}: the {what} rejected the credentials"
            if code == 401
            else f"HTTP 403: the {what} refused access with these credentials"
        ), "check the key or token"
    if code == 407:
        return "HTTP 407: the proxy needs credentials", "put user:password in the proxy URL"
    if code == 404:
        return f"HTTP 404: no such endpoint on the {what}", "check the URL's path (and that it is the right service)"
    if code in (502, 503, 504):
        return f"HTTP {code}: the {what} (or a gateway before it) is unavailable", "retry later; check the server"
    return f"HTTP {code} from the {what}", "check the server's log"


def _status_of(head: bytes) -> int | None:
    parts = head.split(b"\r\n", 1)[0].split()
    try:
        return int(parts[1]) if len(parts) >= 2 and parts[0].startswith(b"HTTP/") else None
    except ValueError:
        return None


def _status_line(head: bytes) -> str:
    return head.split(b"\r\n", 1)[0].decode("latin-1", "replace").strip()
