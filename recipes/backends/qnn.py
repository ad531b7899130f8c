"""Qualcomm QNN (HTP): QnnQuantizer (built here) through torchao's PT2E flow (quant/pt2e.py), then QnnPartitioner
compiles the graph into a QNN context binary inside the .pte. The .pte runs only on a Snapdragon
device; here the column shows the PT2E-simulated model (engine eager-qnn-simulated).

executorch.backends.qualcomm is imported only when a QNN recipe runs: with QNN_SDK_ROOT unset its
import tries to download the QNN SDK. Host libraries are looked up in this order: QNN_SDK_ROOT,
LD_LIBRARY_PATH, ExecuTorch's SDK cache, and PyPI's onnxruntime-qnn (QNN 2.47 libraries plus a
struct-layout shim: for lowering checks, not for shipping; see docs/qnn.md)."""
from __future__ import annotations

import atexit
import ctypes
import dataclasses
import functools
import importlib.metadata
import importlib.util
import os
import shutil
import tempfile
from contextlib import contextmanager
from pathlib import Path

import torch  # before any QNN library: loading them first crashed the adaptor ("Pure virtual function called")

from models.errors import UserFacingError
from quant.pt2e import ANNOTATION, is_output_layer, share_kv_cache_encoding
from quant.pt2e_methods import share_kv_io_encoding
from recipes.evaluation.layer_map import decoder_layer_outputs
from recipes.registry import Backend, recipe

QNN_SDK_VERSION = "2.37.0.250724"  # the QNN SDK the pinned executorch is built against
HOST_LIB_DIR = Path("lib") / "x86_64-linux-clang"
DEFAULT_SOC = "SM8650"
# QNN library versions the deviceCreate shim was checked on (onnxruntime-qnn 2.3.0 and 2.7.0).
SHIM_CHECKED_VERSIONS = ("v2.47.", "v2.51.")
SHIM_LABEL = ("QNN {version} libraries from onnxruntime-qnn {wheel} with a struct-layout shim "
              "— for lowering checks, not for shipping")

# What runs this .pte on a device. With a prefill method (prefill_tokens of 2 or more): Qualcomm's qnn_llama_runner
# in its hybrid mode (examples/qualcomm/oss_scripts/llama/runner), which reads the kv_forward/prefill_forward
# methods, their inputs and outputs and get_n_layers; with prefill_tokens=1, ExecuTorch's generic LLM runner.
DEVICE_RUNNER_HYBRID = (
    "Qualcomm's qnn_llama_runner, hybrid mode (--eval_mode 1): prefill_forward takes prefill_tokens per call "
    "(at most half the context), kv_forward one; the runner keeps the float K/V caches and passes them as inputs and outputs "
    "(docs/qnn.md lists where this program differs from the one Qualcomm's llama.py makes). Not yet run on a device."
)
DEVICE_RUNNER_ONE_METHOD = (
    "ExecuTorch's LLM runner (llama_main, TextLLMRunner) built with the QNN backend: it prefills one token per call "
    "(enable_dynamic_shape is 0); the program keeps its caches inside. Not yet run on a device."
)
# Qualcomm's method names (examples/qualcomm/oss_scripts/llama/decoder_constants.py, DECODER_GRAPH_NAMES).
PREFILL_METHOD, DECODE_METHOD = "prefill_forward", "kv_forward"
DEFAULT_PREFILL_TOKENS = 32  # Qualcomm's llama.py --prefill_ar_len default


def _whole_number(options: dict, key: str, default: int, unit: str, example: str) -> int:
    """A positive whole-number option, as the CLI or the app's number field gives it."""
    value = options.get(key, default)
    if isinstance(value, float) and value.is_integer():  # a form's number field
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise UserFacingError(f"{key} must be a whole number of {unit}, 1 or more (got {value!r}); e.g. {example}.")
    return value


def prefill_tokens(options: dict) -> int:
    return _whole_number(options, "prefill_tokens", DEFAULT_PREFILL_TOKENS, "tokens",
                         f"prefill_tokens={DEFAULT_PREFILL_TOKENS}, or 1 for one method that prefills token by token")


def kv_io_methods(options: dict, context: int) -> dict[str, int] | None:
    """Qualcomm's hybrid program: prefill_forward of prefill_tokens per call (at most half the context, so that
    its cache keeps as many rows as it takes) and kv_forward of one; None for prefill_tokens=1."""
    tokens = min(prefill_tokens(options), context // 2)
    return {PREFILL_METHOD: tokens, DECODE_METHOD: 1} if tokens > 1 else None


def check_qnn_options(options: dict) -> None:
    layers_per_shard(options)
    prefill_tokens(options)


NO_QNN_LIBRARIES = (
    "QNN lowering needs Qualcomm's QNN host libraries (libQnnHtp.so, libQnnSystem.so) and none were found "
    "(looked in $QNN_SDK_ROOT/lib/x86_64-linux-clang, LD_LIBRARY_PATH and {cache}). "
    f"Install the QNN SDK {QNN_SDK_VERSION} (Qualcomm AI Runtime Community) and "
    f"`export QNN_SDK_ROOT=/path/to/qairt/{QNN_SDK_VERSION}`, "
    "or, for lowering checks only, `pip install onnxruntime-qnn==2.3.0`. "
    "The QNN column shows the PT2E-simulated model meanwhile."
)


@dataclasses.dataclass(frozen=True)
class QnnLibraries:
    source: str  # QNN_SDK_ROOT | LD_LIBRARY_PATH | executorch cache | onnxruntime-qnn
    lib_dir: Path  # holds libQnnHtp.so and libQnnSystem.so


def executorch_qnn_cache() -> Path:
    """Where ExecuTorch's own installer (backends/qualcomm/scripts/download_qnn_sdk.py) keeps the SDK."""
    if os.environ.get("QNN_STAGING_DIR"):
        return Path(os.environ["QNN_STAGING_DIR"])
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "executorch" / "qnn"


def onnxruntime_qnn_dir() -> Path | None:
    spec = importlib.util.find_spec("onnxruntime_qnn")  # locates the package without importing it
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(list(spec.submodule_search_locations)[0])


def find_qnn_libraries() -> QnnLibraries | None:
    """The first place that has libQnnHtp.so; checks files only (a failed SDK download leaves an
    empty cache directory behind, so the directory alone proves nothing)."""
    candidates = []
    # a root this module made for onnxruntime-qnn is not a user's SDK: report the wheel, found below
    if os.environ.get("QNN_SDK_ROOT") and Path(os.environ["QNN_SDK_ROOT"]) not in _SHAPED_ROOTS.values():
        candidates.append(("QNN_SDK_ROOT", Path(os.environ["QNN_SDK_ROOT"]) / HOST_LIB_DIR))
    for entry in filter(None, os.environ.get("LD_LIBRARY_PATH", "").split(os.pathsep)):
        candidates.append(("LD_LIBRARY_PATH", Path(entry)))
    candidates.append(("executorch cache", executorch_qnn_cache() / f"sdk-{QNN_SDK_VERSION}" / HOST_LIB_DIR))
    wheel_dir = onnxruntime_qnn_dir()
    if wheel_dir is not None:
        candidates.append(("onnxruntime-qnn", wheel_dir))
    for source, lib_dir in candidates:
        if (lib_dir / "libQnnHtp.so").is_file() and (lib_dir / "libQnnSystem.so").is_file():
            return QnnLibraries(source, lib_dir)
    return None


@contextmanager
def _no_sdk_download():
    """Lets `import executorch.backends.qualcomm` skip its SDK download: the quantizer needs no library."""
    saved = os.environ.get("EXECUTORCH_BUILDING_WHEEL")
    os.environ["EXECUTORCH_BUILDING_WHEEL"] = "1"
    try:
        yield
    finally:
        if saved is None:
            os.environ.pop("EXECUTORCH_BUILDING_WHEEL", None)
        else:
            os.environ["EXECUTORCH_BUILDING_WHEEL"] = saved


def import_qnn_backend() -> None:
    """Imports executorch.backends.qualcomm without triggering its network SDK download."""
    import sys

    _gnu_cxx_runtime_first()
    if "executorch.backends.qualcomm" in sys.modules:
        return
    libraries = find_qnn_libraries()
    if libraries is not None:
        os.environ["QNN_SDK_ROOT"] = str(_sdk_root_for(libraries))
        import executorch.backends.qualcomm  # noqa: F401
    else:
        with _no_sdk_download():
            import executorch.backends.qualcomm  # noqa: F401


_SHAPED_ROOTS: dict[Path, Path] = {}


def _sdk_root_for(libraries: QnnLibraries) -> Path:
    """A QNN_SDK_ROOT whose lib/x86_64-linux-clang/libQnnHtp.so exists: ExecuTorch's
    get_sdk_build_id (called while partitioning embeddings) aborts the process without that file."""
    lib_dir = libraries.lib_dir.resolve()
    if (lib_dir.parent.parent / HOST_LIB_DIR).resolve() == lib_dir:
        return lib_dir.parent.parent
    if lib_dir not in _SHAPED_ROOTS:
        root = Path(tempfile.mkdtemp(prefix="lowerbench-qnn-sdk-"))
        (root / HOST_LIB_DIR).parent.mkdir(parents=True)
        (root / HOST_LIB_DIR).symlink_to(lib_dir, target_is_directory=True)
        atexit.register(shutil.rmtree, root, ignore_errors=True)
        _SHAPED_ROOTS[lib_dir] = root
    return _SHAPED_ROOTS[lib_dir]


@dataclasses.dataclass(frozen=True)
class LoadedQnn:
    libraries: QnnLibraries
    version: str  # QNN build id of libQnnHtp.so, e.g. v2.47.0.260601114230
    label: str  # what the report says about these libraries


_LOADED: LoadedQnn | None = None


def load_qnn_libraries() -> LoadedQnn:
    """Finds the host QNN libraries (fast UserFacingError if there are none), points QNN_SDK_ROOT at
    them and loads them once per process, with the deviceCreate shim for QNN 2.47/2.51."""
    global _LOADED
    libraries = find_qnn_libraries()
    if libraries is None:
        raise UserFacingError(NO_QNN_LIBRARIES.format(cache=executorch_qnn_cache() / f"sdk-{QNN_SDK_VERSION}"))
    if _LOADED is not None:
        if _LOADED.libraries.lib_dir.resolve() != libraries.lib_dir.resolve():
            raise UserFacingError(
                f"QNN libraries from {_LOADED.libraries.lib_dir} are already loaded in this process; "
                f"restart it to use {libraries.lib_dir}."
            )
        os.environ["QNN_SDK_ROOT"] = str(_sdk_root_for(libraries))
        return _LOADED
    os.environ["QNN_SDK_ROOT"] = str(_sdk_root_for(libraries))
    import_qnn_backend()
    from executorch.backends.qualcomm.python import PyQnnManagerAdaptor

    # Safe here: find_qnn_libraries checked the file (a missing one aborts the process, uncatchable).
    version = PyQnnManagerAdaptor.GetQnnSdkBuildId(str(libraries.lib_dir / "libQnnHtp.so"))
    # ExecuTorch dlopens "libQnnHtp.so" by bare name; an already loaded library of that soname is reused.
    htp = ctypes.CDLL(str(libraries.lib_dir / "libQnnHtp.so"), mode=ctypes.RTLD_GLOBAL)
    ctypes.CDLL(str(libraries.lib_dir / "libQnnSystem.so"), mode=ctypes.RTLD_GLOBAL)
    label = f"QNN {version} from {libraries.source} ({libraries.lib_dir})"
    if not version.startswith(f"v{QNN_SDK_VERSION[:4]}"):
        if not version.startswith(SHIM_CHECKED_VERSIONS):
            raise UserFacingError(
                f"the QNN libraries in {libraries.lib_dir} are {version}; "
                f"ExecuTorch {importlib.metadata.version('executorch')} needs QNN {QNN_SDK_VERSION} "
                f"(the struct-layout shim for newer libraries was checked on {', '.join(v + 'x' for v in SHIM_CHECKED_VERSIONS)} only)."
            )
        _patch_device_create(htp)
        label = (SHIM_LABEL.format(version=version, wheel=_wheel_version()) if libraries.source == "onnxruntime-qnn"
                 else f"QNN {version} libraries from {libraries.source} ({libraries.lib_dir}) with a struct-layout shim "
                 "— for lowering checks, not for shipping")
    _LOADED = LoadedQnn(libraries, version, label)
    return _LOADED


def _gnu_cxx_runtime_first() -> None:
    """ExecuTorch dlopens libQnnHtp.so with RTLD_GLOBAL, and the onnxruntime-qnn wheel's copy brings its own
    libc++abi and libunwind into the process's global scope. Every library loaded afterwards (ExecuTorch's LLM
    runner) would then bind __cxa_throw and the unwinder to them and crash on its first C++ exception, in
    libgcc's personality routine. Promoting the already loaded libstdc++ (with its libgcc_s) to the global
    scope first keeps one C++ runtime, the one torch and ExecuTorch are built against, first in every lookup."""
    ctypes.CDLL("libstdc++.so.6", mode=ctypes.RTLD_GLOBAL)


def _wheel_version() -> str:
    try:
        return importlib.metadata.version("onnxruntime-qnn")
    except importlib.metadata.PackageNotFoundError:
        return "?"


_SHIM_KEEPALIVE: list = []


def _patch_device_create(htp: ctypes.CDLL) -> None:
    """QNN 2.47+ moved the union of QnnHtpDevice_CustomConfig_t (QnnHtpDevice.h) from byte offset 4
    to 8; ExecuTorch (1.4.1, 1.5.1) fills it with the 2.37 layout, so QnnDevice_create rejects its SoC config
    ("unknown custom config socModel 0"). This wraps the deviceCreate entry of every QnnInterface_t
    (QnnInterface.h, returned by QnnInterface_getProviders) to copy each custom config's union to
    offset 8. Slot and offsets come from the QNN headers and were confirmed on 2.47 and 2.51 only."""
    get_providers = htp.QnnInterface_getProviders
    get_providers.restype = ctypes.c_int
    get_providers.argtypes = [ctypes.POINTER(ctypes.POINTER(ctypes.c_void_p)), ctypes.POINTER(ctypes.c_uint32)]
    providers, count = ctypes.POINTER(ctypes.c_void_p)(), ctypes.c_uint32()
    if get_providers(ctypes.byref(providers), ctypes.byref(count)) != 0 or count.value == 0:
        raise UserFacingError("QnnInterface_getProviders failed on the onnxruntime-qnn libraries; use the QNN SDK.")
    libc = ctypes.CDLL(None)
    libc.mprotect.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    device_create_t = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.POINTER(ctypes.c_void_p), ctypes.c_void_p)
    for i in range(count.value):
        # QnnInterface_t: backendId(4) + pad(4) + providerName(8) + apiVersion(24) = 40 bytes, then the
        # function table, where deviceCreate is the 41st pointer.
        slot = providers[i] + 40 + 8 * 40
        real = device_create_t(ctypes.c_void_p.from_address(slot).value)

        def device_create(logger, configs, device, _real=real):
            rewritten, j = [], 0
            while configs[j]:  # QnnDevice_Config_t {uint32 option; pad; void* customConfig}
                if ctypes.c_uint32.from_address(configs[j]).value == 0:  # QNN_DEVICE_CONFIG_OPTION_CUSTOM
                    src = ctypes.c_void_p.from_address(configs[j] + 8).value
                    custom = (ctypes.c_uint32 * 16)()
                    ctypes.memmove(custom, src, 4)  # option
                    ctypes.memmove(ctypes.addressof(custom) + 8, src + 4, 40)  # union: offset 4 -> 8
                    config = (ctypes.c_uint64 * 2)(0, ctypes.addressof(custom))
                    _SHIM_KEEPALIVE.extend([custom, config])
                    rewritten.append(ctypes.addressof(config))
                else:
                    rewritten.append(configs[j])
                j += 1
            array = (ctypes.c_void_p * (len(rewritten) + 1))(*rewritten, None)
            _SHIM_KEEPALIVE.append(array)
            return _real(logger, ctypes.cast(array, ctypes.POINTER(ctypes.c_void_p)), device)

        callback = device_create_t(device_create)
        _SHIM_KEEPALIVE.append(callback)
        if libc.mprotect(slot & ~4095, 8192, 3) != 0:  # PROT_READ | PROT_WRITE
            raise UserFacingError("could not patch the QNN interface table (mprotect failed); use the QNN SDK.")
        ctypes.c_void_p.from_address(slot).value = ctypes.cast(callback, ctypes.c_void_p).value


def chipset(options: dict):
    """The QcomChipset named by the `soc` option, and its HTP architecture (e.g. SM8650 -> v75)."""
    import_qnn_backend()
    from executorch.backends.qualcomm.serialization.qc_schema import QcomChipset
    from executorch.backends.qualcomm.utils.utils import get_soc_to_htp_arch_map

    name = str(options.get("soc") or DEFAULT_SOC).upper()
    arches = get_soc_to_htp_arch_map()
    if name not in QcomChipset.__members__ or name not in arches:
        raise UserFacingError(f"unknown Qualcomm SoC {name!r}; choose one of: {', '.join(sorted(arches))}.")
    return QcomChipset[name], f"v{int(arches[name])}"


def qnn_partitioners(options: dict) -> list:
    load_qnn_libraries()
    from executorch.backends.qualcomm.partition.qnn_partitioner import QnnPartitioner
    from executorch.backends.qualcomm.utils.utils import (
        generate_htp_compiler_spec,
        generate_qnn_executorch_compiler_spec,
    )

    soc, _arch = chipset(options)
    # A hybrid program's two methods compile into one context per shard, storing each weight once (HTP v73+).
    hybrid = prefill_tokens(options) > 1
    specs = generate_qnn_executorch_compiler_spec(
        soc_model=soc, backend_options=generate_htp_compiler_spec(use_fp16=False, use_weight_sharing=hybrid))
    return [QnnPartitioner(specs)]


def describe_qnn_options(options: dict) -> dict:
    """What this .pte was compiled for, and with which libraries (loaded by qnn_partitioners)."""
    soc, arch = chipset(options)
    tokens = prefill_tokens(options)
    runner = DEVICE_RUNNER_HYBRID if tokens > 1 else DEVICE_RUNNER_ONE_METHOD
    return {"soc": soc.name, "htp_arch": arch, "qnn_libraries": load_qnn_libraries().label, "device_runner": runner}


# scheme -> QuantDtype member of executorch.backends.qualcomm.quantizer.quantizer
QNN_QUANT_DTYPES = {"16a4w": "use_16a4w", "16a8w": "use_16a8w", "8a8w": "use_8a8w"}

# 16a4w as ExecuTorch's own Qualcomm LLM recipes make it (examples/qualcomm/oss_scripts/llama/
# static_llm_quant_recipe.py): 4-bit weights in blocks of 32 input channels (QNN's LPBQ block-wise expansion),
# and the output layer in 8-bit; per output channel, 4 bits lose far more perplexity (docs/qnn.md).
QNN_16A4W_BLOCK = 32
BLOCK_QUANTIZED_SCHEMES = ("16a4w",)


@functools.cache
def _block_observer_on_qnn_scale_grid():
    from executorch.backends.qualcomm.quantizer.observers.per_block_param_observer import PerBlockParamObserver

    class BlockObserverOnQnnScaleGrid(PerBlockParamObserver):
        """Block scales that QNN's block-wise expansion (LPBQ) stores as they are.

        QNN keeps one float scale per output channel and each block's scale as a 4-bit multiple of it
        (k/16 of the channel's largest block scale, k in 1..16): its node visitor rounds every block's scale
        onto that grid but keeps the integer weights, which convert_pt2e quantized with the unrounded scale.
        The device then computed other numbers than the simulation. Rounded here, before convert_pt2e
        quantizes the weights, the weights, the simulation and the context binary share one set of scales."""

        def calculate_qparams(self):
            scale, zero_point = super().calculate_qparams()
            step = scale.amax(dim=-1, keepdim=True) / self.num_steps
            multiple = torch.clamp(torch.round(scale / step), 1, self.num_steps)
            return multiple * step, zero_point

    return PerBlockParamObserver, BlockObserverOnQnnScaleGrid


def put_block_scales_on_qnn_grid(gm: torch.fx.GraphModule) -> None:
    """A custom annotation (after the quantizer's own): every block-quantized weight observed by
    BlockObserverOnQnnScaleGrid, with the quantizer's own arguments (block size, range, eps)."""
    per_block, on_grid = _block_observer_on_qnn_scale_grid()
    for node in gm.graph.nodes:
        annotation = node.meta.get(ANNOTATION)
        for edge, spec in (annotation.input_qspec_map.items() if annotation else ()):
            make = getattr(spec, "observer_or_fake_quant_ctr", None)
            if getattr(getattr(make, "p", None), "func", None) is per_block:
                annotation.input_qspec_map[edge] = dataclasses.replace(
                    spec, observer_or_fake_quant_ctr=on_grid.with_args(**make.p.keywords))


def qnn_quantizer(scheme: str, options: dict, module: torch.fx.GraphModule):
    """The QnnQuantizer for `scheme`; module: the graph it will annotate (16a4w's block sizes are per node)."""
    soc, _arch = chipset(options)  # also imports executorch.backends.qualcomm without an SDK download
    from executorch.backends.qualcomm.quantizer.quantizer import ModuleQConfig, QnnQuantizer, QuantDtype

    quantizer = QnnQuantizer(soc_model=soc)
    block_quantized = scheme in BLOCK_QUANTIZED_SCHEMES
    # QNN's default activation observer is a moving average: without one shared encoding per KV cache the
    # one-token calls clamp the keys already cached.
    quantizer.add_custom_quant_annotations(
        (share_kv_cache_encoding, share_kv_io_encoding, *((put_block_scales_on_qnn_grid,) if block_quantized else ())))
    if block_quantized:
        quantizer.set_default_quant_config(QuantDtype.use_16a4w_block, is_conv_per_channel=True,
                                           is_linear_per_channel=True)
        linears = [n for n in module.graph.nodes
                   if n.op == "call_function" and n.target == torch.ops.aten.linear.default]
        quantizer.set_block_size_map({n.name: (1, QNN_16A4W_BLOCK) for n in linears if not is_output_layer(n)})
        quantizer.set_submodule_qconfig_list([
            (is_output_layer, ModuleQConfig(QuantDtype.use_16a8w, is_linear_per_channel=True)),
        ])
        return quantizer
    # Per-channel weights: per-tensor weights lose too much on a language model.
    quantizer.set_default_quant_config(
        getattr(QuantDtype, QNN_QUANT_DTYPES[scheme]), is_conv_per_channel=True, is_linear_per_channel=True
    )
    return quantizer


def qnn_program_passes(program: torch.export.ExportedProgram, scheme: str) -> torch.export.ExportedProgram:
    """QNN's export-pipeline passes on the quantized one-token program."""
    import_qnn_backend()
    from executorch.backends.qualcomm._passes.backends.htp.qnn_htp_pass_manager import QnnHtpPassManager

    return QnnHtpPassManager().transform_for_export_pipeline(program)


# Decoder layers per QNN graph. QNN compiles each partition on its own and holds its working set for that
# partition only, so the compile's peak follows the largest shard rather than the whole model (docs/qnn.md);
# the shards run one after another on the device, the residual stream passing between them.
DEFAULT_LAYERS_PER_SHARD = 4


def layers_per_shard(options: dict) -> int:
    return _whole_number(options, "layers_per_shard", DEFAULT_LAYERS_PER_SHARD, "decoder layers",
                         f"layers_per_shard={DEFAULT_LAYERS_PER_SHARD}")


def split_into_shards(edge_program: torch.export.ExportedProgram, per_shard: int) -> None:
    """Ends a QNN partition after every `per_shard` decoder layers: the residual stream leaving that layer goes
    through a `_clone_dim_order`, which QnnPartitioner leaves out for this purpose
    (executorch/backends/qualcomm/partition/common_defs.py)."""
    from executorch.backends.qualcomm.utils.constants import QCOM_QUANT_ATTRS
    from executorch.exir.dialects._ops import ops as exir_ops

    graph = edge_program.graph_module.graph
    nodes = {node.name: node for node in graph.nodes}
    outputs = decoder_layer_outputs(edge_program)
    cuts = [nodes[name] for name in outputs[per_shard - 1:-1:per_shard]]
    for node in cuts:
        with graph.inserting_after(node):
            clone = graph.create_node("call_function", exir_ops.edge.dim_order_ops._clone_dim_order.default, (node,))
        clone.meta.update({k: node.meta[k] for k in ("val", "tensor_meta", "nn_module_stack", QCOM_QUANT_ATTRS)
                           if k in node.meta})
        node.replace_all_uses_with(clone, delete_user_cb=lambda user: user is not clone)
    edge_program.graph_module.recompile()


def qnn_edge_passes(scheme: str, options: dict) -> list:
    """QNN's to_edge stage passes (what to_edge_transform_and_lower_to_qnn hands to
    to_edge_transform_and_lower), run on the edge program itself, then the split into shards. 16a4w: the
    linears go to QNN as 1x1 conv2d (ExecuTorch's ConvertLinearToConv2d, the form upstream's Qualcomm Llama
    uses; block sizes become (1, 32, 1, 1), the same numbers): QNN 2.47's HTP graph prepare rejects a
    block-quantized (LPBQ) FullyConnected with more than 256 output channels ("no properties registered for
    q::GenPad"); Conv2d takes the same weights (docs/qnn.md)."""
    from executorch.exir.pass_base import ExportedProgramPassBase, ExportedProgramPassResult

    per_shard = layers_per_shard(options)
    import_qnn_backend()
    from executorch.backends.qualcomm._passes.backends.htp.qnn_htp_pass_manager import QnnHtpPassManager

    class QnnToEdgePasses(ExportedProgramPassBase):
        def call(self, exported_program):
            QnnHtpPassManager().transform_for_to_edge_pipeline(
                exported_program, convert_linear_to_conv2d=scheme in BLOCK_QUANTIZED_SCHEMES
            )
            split_into_shards(exported_program, per_shard)
            return ExportedProgramPassResult(exported_program, True)

    return [QnnToEdgePasses()]


def qnn_edge_compile_config():
    from executorch.exir import EdgeCompileConfig

    # QNN's passes leave ops (e.g. its own q/dq placement) the edge IR verifier does not know.
    return EdgeCompileConfig(_check_ir_validity=False)


def cannot_run_on_this_host() -> str:
    return "a QNN .pte runs only on a Qualcomm (Snapdragon) device with the QNN runtime, not on this x86_64 host"


# Bytes per weight in the context binary (linears with the 8-bit output layer, embedding): the embedding
# stays outside HTP in fp16 (recipes/estimates/memory_estimate.py).
_PTE_BYTES_4BIT = (0.7, 2.0)
_PTE_BYTES_8BIT = (1.0, 2.0)

BACKEND = Backend(
    name="qnn",
    title="Qualcomm QNN",
    delegate_id="QnnBackend",
    runs_on="Android or Linux devices with a Qualcomm NPU and the QNN runtime libraries",
    partitioners=qnn_partitioners,
    schemes=("16a4w", "16a8w", "8a8w"),
    cannot_run_here=cannot_run_on_this_host,
    # int64 index_put (cache update) and 5-D repeat_interleave fall out of HTP; HTP keeps three q/k/v linears,
    # each with its own static output range.
    attention="sdpa-onehot",
    # The float module PT2E's quantizer takes is exported non-strict: the same program, without the transient
    # copies of every weight strict export (Dynamo) makes, which at 1B were the job's peak.
    strict_export=False,
    # HTP compiles static shapes only: one token per call (prefill runs token by token, as ExecuTorch's QNN
    # Llama runner does in its KV mode).
    static_tokens=1,
    eager_engine="eager-qnn-simulated",
    edge_compile_config=qnn_edge_compile_config,
    transform_passes=qnn_edge_passes,
    describe_options=describe_qnn_options,
    check_options=check_qnn_options,
    kv_io_methods=kv_io_methods,
    pt2e_quantizer=qnn_quantizer,
    pt2e_program_passes=qnn_program_passes,
    # AWQ's search and PT2E's observers over the fp32 module, then the converted copy beside it.
    pt2e_memory_ratio=2.5,
    # The QNN compile holds its graph, its own copy of the weights and their encodings at once: many times the
    # bytes of the shard it compiles (its layers and, in the last one, the output layer), over the QNN
    # libraries' own state. Both fitted to the qnn-16a4w lowering peaks at 135M, 360M and Llama-3.2-1B in
    # shards of four layers.
    lowering_memory_ratio=10.7,
    lowering_memory_base_bytes=1.43e9,
    layers_compiled_at_once=layers_per_shard,
)

QNN_OPTIONS = {"soc": DEFAULT_SOC, "layers_per_shard": DEFAULT_LAYERS_PER_SHARD, "prefill_tokens": DEFAULT_PREFILL_TOKENS}

RECIPES = (
    recipe(BACKEND, "16a4w", "Qualcomm HTP, 16-bit activations, 4-bit weights in blocks of 32, 8-bit output layer "
                             "(PT2E, calibrated; linears lowered as 1x1 conv2d)", options=dict(QNN_OPTIONS),
           pte_bytes=_PTE_BYTES_4BIT),
    recipe(BACKEND, "16a8w", "Qualcomm HTP, 16-bit activations, 8-bit per-channel weights (PT2E, calibrated)",
           options=dict(QNN_OPTIONS), pte_bytes=_PTE_BYTES_8BIT),
    recipe(BACKEND, "8a8w", "Qualcomm HTP, 8-bit activations, 8-bit per-channel weights (PT2E, calibrated)",
           options=dict(QNN_OPTIONS), pte_bytes=_PTE_BYTES_8BIT),
)
