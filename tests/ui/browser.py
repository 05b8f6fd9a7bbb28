"""Headless Chromium driven through the DevTools protocol (a websocket), for checks of real web UIs.

`Browser` starts ``chromium --headless`` with a DevTools port on 127.0.0.1, opens one page and offers
what the UI tests need: go to a URL, evaluate JavaScript, wait for a condition, click, type, take a
screenshot, and the request bodies the page sent (to see the query a UI made).
"""

from __future__ import annotations

import base64
import itertools
import json
import os
import re
import shutil
import subprocess
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

CHROMIUM_FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--no-first-run", "--disable-background-networking",
                  "--disable-component-update", "--disable-sync", "--disable-extensions", "--mute-audio",
                  "--window-size=1600,1000"]


def chromium_path() -> str | None:
    for name in ("chromium", "chromium-browser", "google-chrome"):
        found = shutil.which(name)
        if found:
            return found
    return None


class Browser:
    def __init__(self, timeout_s: float = 60.0):
        from websockets.sync.client import connect

        exe = chromium_path()
        if exe is None:
            raise RuntimeError("chromium is not installed (apt-get install chromium)")
        self._profile = tempfile.mkdtemp(prefix="otel-rl-chromium-")
        self.proc = subprocess.Popen([exe, *CHROMIUM_FLAGS, "--remote-debugging-address=127.0.0.1",
                                      "--remote-debugging-port=0", f"--user-data-dir={self._profile}", "about:blank"],
                                     stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True)
        port = None
        deadline = time.monotonic() + timeout_s
        assert self.proc.stderr is not None
        while time.monotonic() < deadline:
            line = self.proc.stderr.readline().decode("utf-8", "replace")
            if not line and self.proc.poll() is not None:
                raise RuntimeError("chromium exited before its DevTools port was open")
            m = re.search(r"DevTools listening on ws://127\.0\.0\.1:(\d+)/", line)
            if m:
                port = int(m.group(1))
                break
        if port is None:
            self.close()
            raise RuntimeError("chromium did not open its DevTools port")
        # stderr is not read any more: keep the pipe from filling up
        self._drain = subprocess.Popen(["cat"], stdin=self.proc.stderr, stdout=subprocess.DEVNULL)
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/json/list", timeout=10) as r:
            pages = [t for t in json.load(r) if t.get("type") == "page"]
        self._conn = connect(pages[0]["webSocketDebuggerUrl"], max_size=64 << 20, open_timeout=timeout_s)
        self._ws = self._conn.__enter__()
        self._ids = itertools.count(1)
        self.requests: list[dict[str, Any]] = []  # {"url", "method", "postData"} of every request the page sent
        self.call("Page.enable")
        self.call("Runtime.enable")
        self.call("Network.enable")

    # -- protocol ---------------------------------------------------------------------
    def _event(self, msg: dict[str, Any]) -> None:
        if msg.get("method") == "Network.requestWillBeSent":
            req = msg["params"]["request"]
            self.requests.append({"url": req.get("url"), "method": req.get("method"), "postData": req.get("postData")})

    def call(self, method: str, timeout_s: float = 30.0, **params: Any) -> dict[str, Any]:
        n = next(self._ids)
        self._ws.send(json.dumps({"id": n, "method": method, "params": params}))
        deadline = time.monotonic() + timeout_s
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(method)
            msg = json.loads(self._ws.recv(timeout=left))
            if msg.get("id") == n:
                if "error" in msg:
                    raise RuntimeError(f"{method}: {msg['error']}")
                return msg.get("result", {})
            self._event(msg)

    def pump(self, seconds: float) -> None:
        """Take the page's events for `seconds`."""
        deadline = time.monotonic() + seconds
        while (left := deadline - time.monotonic()) > 0:
            try:
                self._event(json.loads(self._ws.recv(timeout=left)))
            except TimeoutError:
                return

    # -- page -------------------------------------------------------------------------
    def goto(self, url: str) -> None:
        self.call("Page.navigate", url=url)

    def eval(self, expression: str) -> Any:
        res = self.call("Runtime.evaluate", expression=expression, returnByValue=True, awaitPromise=True)
        if "exceptionDetails" in res:
            raise RuntimeError(f"{expression[:80]}: {res['exceptionDetails']}")
        return res.get("result", {}).get("value")

    def wait_for(self, expression: str, timeout_s: float = 60.0) -> Any:
        """Evaluate `expression` until it is truthy; its value."""
        deadline = time.monotonic() + timeout_s
        while True:
            value = self.eval(expression)
            if value:
                return value
            if time.monotonic() > deadline:
                raise TimeoutError(f"waiting for {expression!r}")
            self.pump(0.25)

    def click(self, selector: str, index: int = 0) -> None:
        """A real mouse click (pressed, released) in the middle of the `index`-th element matching `selector`."""
        box = self.eval(f"""(() => {{ const e = document.querySelectorAll({json.dumps(selector)})[{index}];
            if (!e) return null; e.scrollIntoView({{block: 'center'}}); const r = e.getBoundingClientRect();
            return [r.x + r.width / 2, r.y + r.height / 2]; }})()""")
        if not box:
            raise LookupError(f"no element {selector!r} [{index}]")
        x, y = box
        self.call("Input.dispatchMouseEvent", type="mouseMoved", x=x, y=y)
        for kind in ("mousePressed", "mouseReleased"):
            self.call("Input.dispatchMouseEvent", type=kind, x=x, y=y, button="left", clickCount=1)
        self.pump(0.3)

    def type(self, text: str) -> None:
        """Type `text` into the focused element."""
        self.call("Input.insertText", text=text)
        self.pump(0.2)

    def key(self, key: str) -> None:
        """Press and release a key such as ``Enter`` or ``Escape``."""
        codes = {"Enter": 13, "Escape": 27, "Tab": 9, "ArrowDown": 40}
        for kind in ("keyDown", "keyUp"):
            self.call("Input.dispatchKeyEvent", type=kind, key=key, code=key,
                      windowsVirtualKeyCode=codes.get(key, 0), text="\r" if key == "Enter" and kind == "keyDown" else "")
        self.pump(0.2)

    def text(self) -> str:
        return self.eval("document.body ? document.body.innerText : ''") or ""

    def screenshot(self, path: Path) -> Path:
        data = self.call("Page.captureScreenshot", format="png")["data"]
        path.write_bytes(base64.b64decode(data))
        return path

    def close(self) -> None:
        try:
            if getattr(self, "_conn", None) is not None:
                self._conn.__exit__(None, None, None)
        except Exception:
            pass
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, 9)
            except ProcessLookupError:
                pass
        self.proc.wait(30)
        if getattr(self, "_drain", None) is not None:
            self._drain.wait(10)
        shutil.rmtree(self._profile, ignore_errors=True)

    def __enter__(self) -> Browser:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
