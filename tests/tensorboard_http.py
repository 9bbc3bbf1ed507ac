"""The real TensorBoard server over a log folder, read through its HTTP API (what its web page fetches): the
run's scalar, text and image tags, scalar values and rendered texts.

Example::

    with TensorBoardServer(log_dir) as board:
        board.get("/data/plugin/scalars/tags")          # {run: {tag: {...}}}
        board.text("version_0", "run/layout")           # the text as the page shows it, tags stripped
"""

from __future__ import annotations

import html
import json
import re
import socket
import subprocess
import sys
import time
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Any, Callable


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


class TensorBoardServer:
    """``python -m tensorboard.main --logdir ...`` on a free local port, stopped on exit."""

    def __init__(self, log_dir: Path, timeout: float = 90.0) -> None:
        self.log_dir, self.timeout = log_dir, timeout
        self.url = ""
        self._process: subprocess.Popen | None = None

    def __enter__(self) -> "TensorBoardServer":
        port = free_port()
        self.url = f"http://127.0.0.1:{port}"
        self._process = subprocess.Popen(
            [sys.executable, "-m", "tensorboard.main", "--logdir", str(self.log_dir), "--host", "127.0.0.1",
             "--port", str(port), "--load_fast", "false", "--reload_interval", "1"],
            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        return self

    def __exit__(self, *exc: Any) -> None:
        assert self._process is not None
        self._process.terminate()
        try:
            self._process.wait(timeout=20)
        except subprocess.TimeoutExpired:
            self._process.kill()
            self._process.wait()

    def get(self, path: str, **query: str) -> Any:
        address = self.url + path + ("?" + urllib.parse.urlencode(query) if query else "")
        with urllib.request.urlopen(address, timeout=20) as response:
            return json.loads(response.read())

    def wait_for(self, ready: Callable[["TensorBoardServer"], bool]) -> None:
        """Poll until ``ready(self)`` (the server answers and has loaded what it needs)."""
        deadline = time.monotonic() + self.timeout
        while True:
            assert self._process is not None
            if self._process.poll() is not None:
                raise RuntimeError(f"TensorBoard exited: {self._process.stderr.read()[-2000:]}")
            try:
                if ready(self):
                    return
            except OSError:  # not listening yet
                pass
            if time.monotonic() > deadline:
                raise TimeoutError(f"TensorBoard at {self.url} did not serve the logs within {self.timeout} s")
            time.sleep(0.5)

    def scalars(self, run: str, tag: str) -> list[tuple[int, float]]:
        """``(step, value)`` of a scalar tag."""
        return [(step, value) for _, step, value in self.get("/data/plugin/scalars/scalars", run=run, tag=tag)]

    def text(self, run: str, tag: str) -> str:
        """The newest text of a tag (``add_text``'s, which TensorBoard lists as ``<tag>/text_summary``) as the page
        renders it, HTML tags replaced by single spaces."""
        rendered = self.get("/data/plugin/text/text", run=run, tag=f"{tag}/text_summary")[-1]["text"]
        return " ".join(html.unescape(re.sub(r"<[^>]+>", " ", rendered)).split())
