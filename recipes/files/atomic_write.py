"""Outputs written whole or not at all: a reader sees the old file or the new one, never a part."""
from __future__ import annotations

import hashlib
import os
import tempfile
from pathlib import Path
from typing import Callable


class _HashingWriter:
    """A file that also counts and hashes what is written to it."""

    def __init__(self, f):
        self.f, self.size, self.hash = f, 0, hashlib.sha256()

    def write(self, data) -> int:
        self.hash.update(data)
        self.size += len(data)
        return self.f.write(data)

    def flush(self) -> None:
        self.f.flush()


def write_atomically(path: Path, data: bytes | Callable) -> tuple[int, str]:
    """Write to a temp file beside `path`, fsync, rename: readers see the old file or the whole new one.
    `data`: the bytes, or a function that writes them to the file it is given. Returns (size, sha256)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".partial")
    try:
        with os.fdopen(fd, "wb") as f:
            writer = _HashingWriter(f)
            if callable(data):
                data(writer)
            else:
                writer.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, 0o644)  # mkstemp creates 0600; outputs are meant to be shared
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return writer.size, writer.hash.hexdigest()
