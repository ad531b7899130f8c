"""Messages the dependencies print on every healthy run that read like failures, silenced one at a time and each
exactly (its logger or warning category, module and text), so anything else they print still shows. Installed
before torch is imported by the CLI, the app and each job's process."""
from __future__ import annotations

import logging
import warnings

_installed = False


def _torchao_cuda_kernels(record: logging.LogRecord) -> bool:
    # torchao's wheel ships CUDA-only kernels that cannot load on a CPU build; nothing Lowerbench runs uses them
    message = record.getMessage()
    return message.startswith("Failed to load") and ("_C_mxfp8" in message or "_C_cutlass_90a" in message)


def _torchao_enum_registration(record: logging.LogRecord) -> bool:
    # torchao registers its enums as pytree constants, which torch now deprecates; nothing changes for a run
    return (str(record.msg).startswith("%s is an Enum subclass and is now natively supported") and bool(record.args)
            and getattr(record.args[0], "__module__", "").startswith("torchao"))


def _coremltools_at_import(record: logging.LogRecord) -> bool:
    message = record.getMessage()
    # its native runtime library ships only on macOS; compiling a Core ML program here does not use it
    native = message.startswith("Failed to load _ML") and "No module named 'coremltools.libcoremlpython'" in message
    # it names the newest torch it was tested with; Lowerbench's Core ML tests run on the torch it pins
    untested_torch = message.startswith("Torch version ") and "has not been tested with coremltools" in message
    # its scikit-learn converters, which Lowerbench never calls, turn themselves off
    sklearn = message.startswith("scikit-learn version ") and "Disabling scikit-learn conversion API" in message
    return native or untested_torch or sklearn


LOG_RECORDS = {"torchao": _torchao_cuda_kernels, "torch.utils._pytree": _torchao_enum_registration,
               "coremltools": _coremltools_at_import}

# (category, message, module) as warnings.filterwarnings takes them (regular expressions matched at the start)
WARNINGS = [
    # ExecuTorch's own KV-cache op calls a torch check torch deprecates; its behaviour is unchanged
    (FutureWarning, r"_check_is_size will be removed", r"executorch\.extension\.llm\.custom_ops\.custom_ops"),
    # torch's pytree deprecation, raised when export copies a tree spec it made itself
    (FutureWarning, r"`isinstance\(treespec, LeafSpec\)` is deprecated", r"copyreg"),
    # the program's mutated buffers are its KV cache, which starts empty: its initial values are meant to be dropped
    (UserWarning, r"Mutation on a buffer in the model is detected", r"executorch\.exir\.emit\._emitter"),
]


class _Drop(logging.Filter):
    def __init__(self, matches):
        super().__init__()
        self.matches = matches

    def filter(self, record: logging.LogRecord) -> bool:
        return not self.matches(record)


def silence_dependency_noise() -> None:
    """Once per process, before the dependencies are imported (torchao logs at import)."""
    global _installed
    if _installed:
        return
    for logger, matches in LOG_RECORDS.items():
        logging.getLogger(logger).addFilter(_Drop(matches))
    for category, message, module in WARNINGS:
        warnings.filterwarnings("ignore", message=message, category=category, module=module)
    _installed = True
