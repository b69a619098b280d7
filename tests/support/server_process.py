"""A real ``python -m dflash.server`` in a subprocess, for the server tests and the load
benchmark (``benchmarks/server_load.py``)."""

import os
import re
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import List

ROOT = Path(__file__).resolve().parents[2]
# The line the server prints once it listens (dflash.server.cli's banner).
LISTENING = re.compile(r"at http://([^:\s]+):(\d+)")


class ServerProcess:
    """``python -m dflash.server`` on a free loopback port, stopped by :meth:`close` (or at
    the end of a ``with`` block).

    Attributes:
        url: ``http://host:port`` of the server.
        banner: The line the server printed when it started listening.
        log: Its stderr lines so far.

    Args:
        args: Extra flags.
        timeout: Seconds to wait for the server to listen.
    """

    def __init__(self, *args: str, timeout: float = 180.0):
        command = [
            sys.executable,
            "-m",
            "dflash.server",
            "--host",
            "127.0.0.1",
            "--port",
            "0",
        ]
        command += ["--log-level", "WARNING", *args]
        self.process = subprocess.Popen(
            command,
            cwd=ROOT,
            stderr=subprocess.PIPE,
            stdout=subprocess.DEVNULL,
            text=True,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )
        self.log: List[str] = []
        self.banner = ""
        self.url = self._wait_listening(timeout)
        threading.Thread(target=self._drain, daemon=True).start()

    def _wait_listening(self, timeout: float) -> str:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            line = self.process.stderr.readline()
            if not line:
                if self.process.poll() is not None:
                    raise RuntimeError(f"the server exited: {''.join(self.log)}")
                continue
            self.log.append(line)
            match = LISTENING.search(line)
            if match:
                self.banner = line.strip()
                return f"http://{match.group(1)}:{match.group(2)}"
        self.close()
        raise RuntimeError(
            f"the server did not start in {timeout} s: {''.join(self.log)}"
        )

    def _drain(self) -> None:
        for line in self.process.stderr:
            self.log.append(line)

    @property
    def base_url(self) -> str:
        return self.url + "/v1"

    def __enter__(self) -> "ServerProcess":
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    def close(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
