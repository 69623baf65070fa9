"""A page in headless Chromium driven over the DevTools protocol on a pipe
(``--remote-debugging-pipe``: commands on descriptor 3, answers on 4, each JSON message ended
by a NUL byte), so a test can ask the page's real layout at a given width (what ``--dump-dom``
cannot tell), and screenshot it. No package beyond the standard library."""

from __future__ import annotations

import asyncio
import base64
import fcntl
import json
import os
import shutil
import subprocess
import time

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")


class Page:
    """One tab at ``width`` x ``height`` CSS pixels."""

    def __init__(self, profile: str, width: int, height: int) -> None:
        self.profile = profile
        self.width, self.height = width, height
        self._next = 0
        self.session: str | None = None

    def __enter__(self) -> "Page":
        to_browser_r, self._to_browser = os.pipe()
        self._from_browser, from_browser_w = os.pipe()
        # Above 4, so that the shell's redirections cannot overwrite one with the other.
        low = (to_browser_r, from_browser_w)
        to_browser_r, from_browser_w = (fcntl.fcntl(fd, fcntl.F_DUPFD, 10) for fd in low)
        for fd in low:
            os.close(fd)
        # The browser reads descriptor 3 and writes descriptor 4 (set up by the shell it is exec'd from).
        args = [CHROMIUM, "--headless", "--disable-gpu", "--no-sandbox", "--no-first-run", "--disable-extensions",
                "--hide-scrollbars", f"--user-data-dir={self.profile}", "--remote-debugging-pipe",
                f"--window-size={self.width},{self.height}", "about:blank"]
        self.proc = subprocess.Popen(["bash", "-c", f'exec "$@" 3<&{to_browser_r} 4>&{from_browser_w}', "bash", *args],
                                     pass_fds=(to_browser_r, from_browser_w), stdout=subprocess.DEVNULL,
                                     stderr=subprocess.DEVNULL)
        os.close(to_browser_r)
        os.close(from_browser_w)
        self._buffer = b""
        targets = self.call("Target.getTargets")["targetInfos"]
        page = next(t for t in targets if t["type"] == "page")
        self.session = self.call("Target.attachToTarget", targetId=page["targetId"], flatten=True)["sessionId"]
        self.call("Emulation.setDeviceMetricsOverride", width=self.width, height=self.height, deviceScaleFactor=1,
                  mobile=False)
        return self

    def __exit__(self, *exc) -> None:
        try:
            self.session = None
            self.call("Browser.close")
        except Exception:  # noqa: BLE001 - the browser may be gone already
            pass
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        os.close(self._to_browser)
        os.close(self._from_browser)

    def call(self, method: str, timeout: float = 30, **params) -> dict:
        self._next += 1
        msg: dict = {"id": self._next, "method": method, "params": params}
        if self.session is not None and not method.startswith(("Target.", "Browser.")):
            msg["sessionId"] = self.session
        os.write(self._to_browser, json.dumps(msg).encode() + b"\0")
        end = time.monotonic() + timeout
        while True:
            while b"\0" in self._buffer:
                raw, self._buffer = self._buffer.split(b"\0", 1)
                answer = json.loads(raw)
                if answer.get("id") == self._next:
                    if "error" in answer:
                        raise RuntimeError(f"{method}: {answer['error']}")
                    return answer["result"]
            if time.monotonic() > end:
                raise TimeoutError(method)
            chunk = os.read(self._from_browser, 1 << 16)
            if not chunk:
                raise RuntimeError("the browser closed its pipe")
            self._buffer += chunk

    def open(self, url: str) -> None:
        self.call("Page.enable")
        self.call("Page.navigate", url=url)

    def evaluate(self, expression: str):
        """The value of ``expression`` in the page (a promise is awaited)."""
        result = self.call("Runtime.evaluate", expression=expression, awaitPromise=True, returnByValue=True)
        if "exceptionDetails" in result:
            raise RuntimeError(result["exceptionDetails"])
        return result["result"].get("value")

    def wait_for(self, condition: str, timeout: float = 20) -> None:
        """Until the page's ``condition`` (an expression) is true (an error, e.g. an element not
        there yet while the page loads, counts as not yet)."""
        end = time.monotonic() + timeout
        guarded = f"(() => {{ try {{ return Boolean({condition}); }} catch (e) {{ return false; }} }})()"
        while not self.evaluate(guarded):
            if time.monotonic() > end:
                raise TimeoutError(condition)
            time.sleep(0.1)

    def screenshot(self, path: str, full: bool = True) -> None:
        params: dict = {"format": "png"}
        if full:
            params["captureBeyondViewport"] = True
            size = self.evaluate("[document.documentElement.scrollWidth, document.documentElement.scrollHeight]")
            params["clip"] = {"x": 0, "y": 0, "width": size[0], "height": size[1], "scale": 1}
        with open(path, "wb") as f:
            f.write(base64.b64decode(self.call("Page.captureScreenshot", **params)["data"]))


async def in_thread(fn, *args):
    """A blocking browser session off the event loop the servers under test run on."""
    return await asyncio.get_running_loop().run_in_executor(None, fn, *args)
