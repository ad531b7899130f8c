"""The tokenizer files a recipe folder ships beside model.pte: tokenizer.json (what ExecuTorch's LLM runners
load) and tokenizer_config.json with the chat template in it (the runners take raw text, so a device app
needs the template). Made with the tokenizer's own save_pretrained, which also turns a GGUF's tokenizer
into these files."""
from __future__ import annotations

import tempfile
from pathlib import Path

from models.errors import UserFacingError

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")


def tokenizer_files(tokenizer) -> dict[str, bytes]:
    with tempfile.TemporaryDirectory(prefix="lowerbench-tokenizer-") as folder:
        # save_jinja_files=False: the chat template goes into tokenizer_config.json, not chat_template.jinja
        tokenizer.save_pretrained(folder, save_jinja_files=False)
        missing = [name for name in TOKENIZER_FILES if not (Path(folder) / name).is_file()]
        if missing:
            raise UserFacingError(
                f"this tokenizer saves no {', '.join(missing)} (only a fast, tokenizers-backed tokenizer does), "
                "so no runner on a device could load it; use a checkpoint whose tokenizer has a tokenizer.json."
            )
        return {name: (Path(folder) / name).read_bytes() for name in TOKENIZER_FILES}
