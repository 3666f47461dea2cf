"""A headless Chromium (Debian's `chromium`) driven over the DevTools protocol, to read what the Prefect UI shows a
person: the page's rendered text after its scripts ran, and screenshots.

Only loopback: the browser starts with background networking, component updates and sync off, in a fresh
profile, and is only pointed at 127.0.0.1.
"""

from __future__ import annotations

import base64
import itertools
import json
import os
import shutil
import subprocess
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
from websockets.sync.client import ClientConnection, connect

CHROMIUM_FLAGS = (
    "--headless=new",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
    "--no-default-browser-check",
    "--window-size=1600,1100",
    "--remote-debugging-port=0",
)
MISSING = "Debian's chromium is not installed: `apt-get install -y chromium` (.ci/run installs it)"


def chromium_path() -> str | None:
    return shutil.which("chromium") or shutil.which("chromium-browser")


class Browser:
    """One page of a headless Chromium; `open` a URL, `wait_for` its text, `screenshot` it."""

    def __init__(self, out_dir: Path, timeout_s: float = 60.0) -> None:
        binary = chromium_path()
        if binary is None:
            raise RuntimeError(MISSING)
        self.out_dir = out_dir
        self.out_dir.mkdir(parents=True, exist_ok=True)
        self.profile = Path(tempfile.mkdtemp(prefix="eagle3-chromium-"))
        log = (self.out_dir / "chromium.log").open("wb")
        args = [binary, *CHROMIUM_FLAGS, f"--user-data-dir={self.profile}", "about:blank"]
        self.proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        port_file = self.profile / "DevToolsActivePort"
        deadline = time.monotonic() + timeout_s
        while not (port_file.is_file() and port_file.read_text().strip()):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"chromium did not start: {(self.out_dir / 'chromium.log').read_text()[-2000:]}")
            time.sleep(0.1)
        port = int(port_file.read_text().split()[0])
        pages = [t for t in httpx.get(f"http://127.0.0.1:{port}/json", timeout=10).json() if t["type"] == "page"]
        self.ws: ClientConnection = connect(pages[0]["webSocketDebuggerUrl"], max_size=None, open_timeout=30)
        self._ids = itertools.count(1)
        self.send("Page.enable")

    def send(self, method: str, params: dict[str, Any] | None = None, timeout_s: float = 60.0) -> dict[str, Any]:
        call = next(self._ids)
        self.ws.send(json.dumps({"id": call, "method": method, "params": params or {}}))
        deadline = time.monotonic() + timeout_s
        while True:
            message = json.loads(self.ws.recv(timeout=max(0.1, deadline - time.monotonic())))
            if message.get("id") == call:
                if "error" in message:
                    raise RuntimeError(f"{method}: {message['error']}")
                result: dict[str, Any] = message.get("result", {})
                return result

    def open(self, url: str) -> None:
        self.send("Page.navigate", {"url": url})

    def text(self) -> str:
        result = self.send("Runtime.evaluate", {"expression": "document.body ? document.body.innerText : ''"})
        return str(result.get("result", {}).get("value", ""))

    def table_rows(self) -> list[list[str]]:
        """The cells of every table row on the page, as rendered text."""
        script = "Array.from(document.querySelectorAll('tr')).map(r => Array.from(r.cells).map(c => c.innerText))"
        result = self.send("Runtime.evaluate", {"expression": script, "returnByValue": True})
        rows: list[list[str]] = result.get("result", {}).get("value", [])
        return rows

    def wait_for(self, ready: Callable[[str], bool], what: str, timeout_s: float = 90.0) -> str:
        """The page's text once `ready(text)` holds; the last text in the error otherwise."""
        deadline = time.monotonic() + timeout_s
        text = ""
        while time.monotonic() < deadline:
            text = self.text()
            if ready(text):
                return text
            time.sleep(0.5)
        raise AssertionError(f"the page never showed {what} within {timeout_s:g} s; it shows:\n{text[:4000]}")

    def screenshot(self, name: str) -> Path:
        """A full-page PNG in the output folder."""
        metrics = self.send("Page.getLayoutMetrics")
        size = metrics.get("cssContentSize") or metrics.get("contentSize") or {}
        width, height = int(size.get("width", 1600)), min(int(size.get("height", 1100)), 8000)
        clip = {"x": 0, "y": 0, "width": max(width, 1), "height": max(height, 1), "scale": 1}
        shot = self.send("Page.captureScreenshot", {"format": "png", "captureBeyondViewport": True, "clip": clip})
        path = self.out_dir / f"{name}.png"
        path.write_bytes(base64.b64decode(shot["data"]))
        return path

    def close(self) -> None:
        try:
            self.ws.close()
        finally:
            if self.proc.poll() is None:
                os.killpg(self.proc.pid, 15)
                try:
                    self.proc.wait(timeout=20)
                except subprocess.TimeoutExpired:
                    os.killpg(self.proc.pid, 9)
            shutil.rmtree(self.profile, ignore_errors=True)
