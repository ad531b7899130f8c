#!/usr/bin/env bash
# Installs what `python3 -m bench` needs beyond the project: matplotlib, psutil, llama-cpp-python (built
# from source once, wheel cached in bench/.cache/wheels) and, in its own venv because it pins
# transformers 5.0.0rc1, optimum-executorch. The system packages are left as they are.
set -euo pipefail
cd "$(dirname "$0")"
PY=${PYTHON:-python3}
LLAMA_CPP=$(grep -E '^llama-cpp-python==' requirements.txt)
mkdir -p .cache/wheels
if ! ls .cache/wheels/llama_cpp_python-*.whl >/dev/null 2>&1; then
    echo "building $LLAMA_CPP from source (several minutes)" >&2
    # Only the text model library: llava/mtmd, tests, examples and tools are most of the compile time
    # and the benchmark uses none of them. GGML_NATIVE builds one CPU variant for this machine.
    CMAKE_ARGS="-DLLAVA_BUILD=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_TOOLS=OFF \
        -DLLAMA_BUILD_SERVER=OFF -DGGML_NATIVE=ON ${CMAKE_ARGS:-}" \
    CMAKE_BUILD_PARALLEL_LEVEL=${CMAKE_BUILD_PARALLEL_LEVEL:-2} \
        "$PY" -m pip wheel --no-deps --no-binary llama-cpp-python "$LLAMA_CPP" -w .cache/wheels
fi
"$PY" -m pip install --find-links .cache/wheels --only-binary llama-cpp-python -r requirements.txt
if [ ! -x .venv-optimum/bin/optimum-cli ]; then
    # A plain venv (no system site-packages): torch 2.13.0 is the CPU build on local disk.
    "$PY" -m venv .venv-optimum
    .venv-optimum/bin/pip install torch==2.13.0 executorch==1.4.1 optimum-executorch==1.1.0
fi
