"""ExecuTorch's C++ log into a file in the job's folder instead of the terminal.

The log reaches the process two ways. Kernels and libraries called outside the pybindings (custom ops run eagerly,
the LLM runner's tokenizers, the threadpool before the pybindings load) write to file descriptor 2, so fd 2 points
at the file while the job runs. Inside a pybindings call the runtime's log goes through Python's sys.stderr
(pybind11's scoped_estream_redirect) as `[file.cpp:line] message` lines, so sys.stderr becomes a
splitter: those lines into the file, everything else (progress lines, warnings, errors) to the terminal."""
from __future__ import annotations

import io
import os
import re
import sys
from contextlib import contextmanager
from pathlib import Path

LOG_NAME = "executorch.log"
# How the pybindings begin a log line; they write it in pieces ("[", the file, ":", the line, "] ", the message).
RUNTIME_LINE = re.compile(r"\[[\w./-]+\.(?:c|cc|cpp|h|hpp):\d+\] ")
MAY_BECOME_ONE = re.compile(r"\[[\w./-]*(?::\d*)?\]?")


class _Splitter(io.TextIOBase):
    """A stand-in for sys.stderr that sends the runtime's log lines to `log` and all other text to `terminal`.
    A line's beginning is held back only while it may still become a runtime line; then the whole line goes
    where its beginning went."""

    def __init__(self, terminal: io.TextIOBase, log: io.TextIOBase):
        self.terminal, self.log = terminal, log
        self._destination: io.TextIOBase | None = None  # where the current line goes; None at a line's start
        self._held = ""

    def write(self, text: str) -> int:
        self._held += text
        while self._held:
            if self._destination is None:
                if RUNTIME_LINE.match(self._held):
                    self._destination = self.log
                elif MAY_BECOME_ONE.fullmatch(self._held):
                    break
                else:
                    self._destination = self.terminal
            line, newline, self._held = self._held.partition("\n")
            self._destination.write(line + newline)
            self._destination.flush()
            if newline:
                self._destination = None
        return len(text)

    def release(self) -> None:
        """What is still held back goes to the terminal."""
        if self._held:
            self.terminal.write(self._held)
            self._held = ""
        self.flush()

    def flush(self) -> None:
        self.terminal.flush()
        self.log.flush()

    def fileno(self) -> int:
        return self.terminal.fileno()

    def isatty(self) -> bool:
        return self.terminal.isatty()

    @property
    def encoding(self):
        return self.terminal.encoding


@contextmanager
def runtime_log_to(path: Path):
    """The runtime's log goes into `path` inside the block (its folder is made if missing); an empty log is removed
    after, with any folder made for it that stayed empty."""
    path = Path(path)
    made = [folder for folder in (path.parent, *path.parent.parents) if not folder.exists()]
    path.parent.mkdir(parents=True, exist_ok=True)
    python_stderr = sys.stderr
    python_stderr.flush()
    kept = os.dup(2)
    encoding = getattr(python_stderr, "encoding", None) or "utf-8"
    terminal = io.TextIOWrapper(io.FileIO(os.dup(kept), "w"), encoding=encoding, errors="backslashreplace")
    try:
        with open(path, "w", encoding="utf-8", errors="backslashreplace") as log:
            os.dup2(log.fileno(), 2)
            sys.stderr = _Splitter(terminal, log)
            try:
                yield path
            finally:
                sys.stderr.release()
                sys.stderr = python_stderr
                os.dup2(kept, 2)
                os.close(kept)
                terminal.close()
    finally:
        if path.is_file() and path.stat().st_size == 0:
            path.unlink()
            for folder in made:
                if folder.is_dir() and not any(folder.iterdir()):
                    folder.rmdir()
