"""The user's own calibration text (`--calibration-file`, the app's upload), in place of the built-in one: read and
checked before any weight is read, then tokenized with the model's tokenizer. Two forms: plain UTF-8 text, or a
`.jsonl` file whose every line is a chat ({"messages": [{"role", "content"}, ...]}, or that list itself), each
formatted with the model's own chat template and their tokens concatenated.

Its contents are never logged or echoed: a refusal names the file and the line, never the text."""
from __future__ import annotations

import hashlib
import json
import os
import stat
from dataclasses import dataclass, replace
from pathlib import Path

from models.errors import UserFacingError, last_line
from models.prompting import chat_token_ids

# Far beyond what any algorithm reads (GPTQ: 8192 tokens, some 40 kB of text); a cap keeps a wrong file (a
# checkpoint, a dump) from being read into memory whole.
MAX_CALIBRATION_FILE_BYTES = 64 * 2**20
JSONL_SUFFIX = ".jsonl"
# A long enough file also gives a fidelity figure on its own kind of text: its last fifth, past every token
# calibration read, when that is at least HELDOUT_MIN_TOKENS (fewer make a noisy perplexity), and at most
# HELDOUT_MAX_TOKENS, because the reference keeps a vocabulary-wide row of logits per token scored.
HELDOUT_FRACTION = 0.2
HELDOUT_MIN_TOKENS = 256
HELDOUT_MAX_TOKENS = 1024
FORMS = "a UTF-8 text file, or a .jsonl file of chats (one {\"messages\": [{\"role\", \"content\"}, ...]} a line)"


@dataclass(frozen=True)
class CalibrationFile:
    """A calibration file as read: its name (never its path, which may be a server's upload folder), the SHA-256
    of its bytes, and its text or its chats; once tokenized, its token ids (the text and chats are let go)."""
    name: str
    sha256: str
    text: str | None = None
    chats: tuple[tuple[int, list[dict]], ...] = ()  # (line number, messages)
    chat_count: int = 0
    ids: tuple[int, ...] = ()

    @property
    def describe(self) -> str:
        """What the report's quantization.calibration.text says of it."""
        if self.chat_count:
            return f"{self.name} (calibration file: {self.chat_count} chats, each in the model's chat template)"
        return f"{self.name} (calibration file: plain text)"

    def heldout_ids(self, read_tokens: int) -> list[int]:
        """The tokenized file's held-out slice: its last HELDOUT_FRACTION, none of its first read_tokens (what
        calibration read), at most its last HELDOUT_MAX_TOKENS; [] when fewer than HELDOUT_MIN_TOKENS remain."""
        start = max(read_tokens, len(self.ids) - int(len(self.ids) * HELDOUT_FRACTION))
        ids = list(self.ids[start:])[-HELDOUT_MAX_TOKENS:]
        return ids if len(ids) >= HELDOUT_MIN_TOKENS else []

    def heldout_describe(self, tokens: int) -> str:
        """What the report's fidelity.calibration_heldout.text says of the slice."""
        return f"{self.name}: its last {tokens} tokens, held out of calibration (not a fixed text: recipes compare " \
               "on fidelity and fidelity.heldout)"

    def tokenized(self, tokenizer) -> CalibrationFile:
        """Its tokens by the model's tokenizer: the plain text as the built-in text is read (no special tokens
        added), or each chat through the chat template, in file order."""
        if self.text is not None:
            ids = tokenizer(self.text, add_special_tokens=False)["input_ids"]
        else:
            ids = [token for line, messages in self.chats for token in self._chat_ids(tokenizer, line, messages)]
        return replace(self, text=None, chats=(), ids=tuple(ids))

    def _chat_ids(self, tokenizer, line: int, messages: list[dict]) -> list[int]:
        if not getattr(tokenizer, "chat_template", None):
            raise UserFacingError(f"calibration file {self.name!r} holds chats, but this model's tokenizer has no chat "
                                  "template to format them; give the text as a plain text file instead.")
        try:
            return chat_token_ids(tokenizer, messages)
        except Exception as err:  # the template's own refusal, e.g. roles that do not alternate
            raise UserFacingError(f"calibration file {self.name!r}, line {line}: the model's chat template refused "
                                  f"this chat ({last_line(err)}); fix or remove the line.") from None


def read_calibration_file(path: str | os.PathLike) -> CalibrationFile:
    """The file read and checked: a regular file within MAX_CALIBRATION_FILE_BYTES, UTF-8 text that is not
    empty and, for .jsonl, a chat on every non-blank line. Raises UserFacingError saying what to fix."""
    path = Path(path).expanduser()
    name = path.name
    try:
        found = path.stat()
    except FileNotFoundError:
        raise UserFacingError(f"calibration file {str(path)!r} does not exist; give the path of {FORMS}.") from None
    except OSError as err:
        raise UserFacingError(f"calibration file {name!r} cannot be read ({err.strerror}).") from None
    if not stat.S_ISREG(found.st_mode):
        raise UserFacingError(f"calibration file {name!r} is not a regular file; give {FORMS}.")
    if found.st_size > MAX_CALIBRATION_FILE_BYTES:
        raise UserFacingError(f"calibration file {name!r} is {found.st_size / 2**20:.0f} MB, over the "
                              f"{MAX_CALIBRATION_FILE_BYTES // 2**20} MB limit; a few hundred kB of text is plenty.")
    try:
        with open(path, "rb") as file:
            data = file.read(MAX_CALIBRATION_FILE_BYTES + 1)  # the size may have changed since stat
    except OSError as err:
        raise UserFacingError(f"calibration file {name!r} cannot be read ({err.strerror}).") from None
    if len(data) > MAX_CALIBRATION_FILE_BYTES:
        raise UserFacingError(f"calibration file {name!r} is over the {MAX_CALIBRATION_FILE_BYTES // 2**20} MB limit.")
    text = _decoded(name, data)
    digest = hashlib.sha256(data).hexdigest()
    if path.suffix.lower() != JSONL_SUFFIX:
        return CalibrationFile(name, digest, text=text)
    chats = tuple(_chats(name, text))
    if not chats:
        raise UserFacingError(f"calibration file {name!r} has no chat on any line; give {FORMS}.")
    return CalibrationFile(name, digest, chats=chats, chat_count=len(chats))


def _decoded(name: str, data: bytes) -> str:
    if not data.strip():
        raise UserFacingError(f"calibration file {name!r} is empty; give {FORMS}.")
    if b"\0" in data:
        raise UserFacingError(f"calibration file {name!r} is binary, not UTF-8 text; give {FORMS}.")
    try:
        return data.decode("utf-8-sig")
    except UnicodeDecodeError as err:
        raise UserFacingError(f"calibration file {name!r} is not UTF-8 text (an invalid byte at offset {err.start}); "
                              "save it as UTF-8.") from None


def _chats(name: str, text: str):
    """(line number, messages) of every non-blank line."""
    for number, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as err:
            raise UserFacingError(f"calibration file {name!r}, line {number}: not JSON ({err.msg} at column "
                                  f"{err.colno}); each line must be one chat, {{\"messages\": [...]}}.") from None
        messages = record.get("messages") if isinstance(record, dict) else record
        if not (isinstance(messages, list) and messages and all(_is_message(m) for m in messages)):
            raise UserFacingError(f"calibration file {name!r}, line {number}: no \"messages\" list of chat messages, "
                                  "each {\"role\": ..., \"content\": \"...\"} with text for both.")
        yield number, messages


def _is_message(message) -> bool:
    return (isinstance(message, dict) and isinstance(message.get("role"), str)
            and isinstance(message.get("content"), str))
