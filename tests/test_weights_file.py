"""The program's weights in model.ptd beside model.pte: ExecuTorch's runtime and its LLM runner load the pair and
compute exactly what the single file computes, and a lowering that writes it never holds the packed weights in
memory at the serialize stage."""
import gc
from pathlib import Path

import pytest
import torch

from recipes.request import RunRequest
from recipes.pipeline.run import run

PROMPT = "what is the capital of France ?"


def _export_only(model_dir, out, weights_file, recipe="xnnpack-8da4w", max_seq_len=64, options=None):
    summary = run(RunRequest(recipes=[recipe], out_dir=out, model=model_dir and str(model_dir), max_seq_len=max_seq_len,
                             generate=False, weights_file=weights_file, options=options or {}))
    (report,) = summary.recipes
    assert not report.errors, report.errors
    return report


def _runner_pieces(folder, model_dir):
    from models.sources.checkpoint import load_checkpoint
    from recipes.running.llm_runner import generate_with_runner

    checkpoint = load_checkpoint(model_dir and str(model_dir))
    generation = generate_with_runner(folder / "model.pte", folder / "tokenizer.json", checkpoint.tokenizer, PROMPT,
                                      12, eos_token_ids=checkpoint.eos_token_ids)
    return generation.pieces


def _runtime_logits(pte):
    from recipes.running import generate

    _program, method = generate.load_runtime_method(pte, ("executorch.extension.llm.custom_ops.custom_ops",
                                                          "executorch.kernels.quantized"))
    prefill = method.execute([torch.tensor([[5, 17, 40, 3, 60, 41]]), torch.tensor([0])])[0].clone()
    decode = method.execute([torch.tensor([[7]]), torch.tensor([6])])[0].clone()
    return prefill, decode


# An int8 KV cache in a ring: the pair must carry the cache's form (its scales, its ring rows) as well as the weights.
CACHE_OPTIONS = {"kv_cache": "int8", "kv_cache_window": 32}


@pytest.fixture(scope="module")
def tiny_pair_and_single(runner_llama_dir, tmp_path_factory):
    single, pair = tmp_path_factory.mktemp("single"), tmp_path_factory.mktemp("pair")
    return ((single, _export_only(runner_llama_dir, single, False, options=CACHE_OPTIONS)),
            (pair, _export_only(runner_llama_dir, pair, True, options=CACHE_OPTIONS)))


def test_pair_holds_the_weights_and_the_program_alone_is_small(tiny_pair_and_single):
    (single, single_report), (pair, pair_report) = tiny_pair_and_single
    assert not (single / "model.ptd").exists() and single_report.pte.ptd_path is None
    assert (pair / "model.ptd").stat().st_size == pair_report.pte.ptd_bytes > 0
    assert pair_report.pte.ptd_path == str(pair / "model.ptd")
    # the delegates' weights left the program: the pair's .pte is what the single file keeps besides them
    assert pair_report.pte.bytes < single_report.pte.bytes
    moved = single_report.pte.bytes - pair_report.pte.bytes
    assert abs(pair_report.pte.ptd_bytes - moved) < 4096  # the same data, each file with its own header
    assert not [p.name for p in pair.rglob(".*")], "scratch files of the lowering are left behind"


def test_pair_computes_exactly_the_single_files_logits(tiny_pair_and_single):
    (single, _), (pair, _) = tiny_pair_and_single
    for alone, with_data in zip(_runtime_logits(single / "model.pte"), _runtime_logits(pair / "model.pte")):
        assert torch.equal(alone, with_data)


def test_pte_without_its_ptd_does_not_run(tiny_pair_and_single, tmp_path):
    """The weights are only in the .ptd: the program alone fails to load (ExecuTorch aborts the process, so the
    load runs in its own)."""
    import subprocess
    import sys

    (_, _), (pair, _) = tiny_pair_and_single
    (tmp_path / "model.pte").write_bytes((pair / "model.pte").read_bytes())
    script = ("import sys, torch; from recipes.running import generate; p, m = generate.load_runtime_method(sys.argv[1], "
              "('executorch.extension.llm.custom_ops.custom_ops', 'executorch.kernels.quantized')); "
              "m.execute([torch.tensor([[5]]), torch.tensor([0])]); print('RAN')")
    result = subprocess.run([sys.executable, "-c", script, str(tmp_path / "model.pte")], capture_output=True,
                            text=True, timeout=600, cwd=Path(__file__).resolve().parent.parent)
    assert result.returncode != 0 and "RAN" not in result.stdout


def test_llm_runner_gives_the_same_tokens_from_the_pair(tiny_pair_and_single, runner_llama_dir):
    (single, _), (pair, _) = tiny_pair_and_single
    alone = _runner_pieces(single, runner_llama_dir)
    assert alone and _runner_pieces(pair, runner_llama_dir) == alone


def test_full_job_with_the_pair_generates_profiles_and_ships_it(runner_llama_dir, tmp_path):
    from recipes.output.publish import model_card, zip_recipe_folder

    summary = run(RunRequest(recipes=["xnnpack-8da4w"], out_dir=tmp_path, model=str(runner_llama_dir),
                             prompt=PROMPT, max_new_tokens=8, max_seq_len=64, weights_file=True))
    (report,) = summary.recipes
    assert not report.errors and report.pte.ptd_bytes
    engines = {g.engine: g for g in report.generations}
    assert engines["executorch-llm-runner"].text == engines["executorch-runtime"].text
    assert report.profile is not None and report.profile.decode is not None
    card = model_card(report)
    assert "--data_paths=model.ptd" in card and 'data_path="model.ptd"' in card
    import zipfile

    with zipfile.ZipFile(zip_recipe_folder(tmp_path, tmp_path / "out.zip")) as archive:
        assert {"model.pte", "model.ptd", "README.md"} <= set(archive.namelist())


def test_size_decides_the_pair_when_not_asked(tiny_checkpoint):
    from recipes.registry import get_recipe
    from recipes.pipeline.run import DATA_FILE_ABOVE_BYTES, writes_data_file

    config = tiny_checkpoint.config
    xnnpack, coreml = get_recipe("xnnpack-8da4w"), get_recipe("coreml-int4")
    request = RunRequest(recipes=["xnnpack-8da4w"], out_dir=".")
    assert not writes_data_file(xnnpack, request, config)
    request.weights_file = True
    assert writes_data_file(xnnpack, request, config) and not writes_data_file(coreml, request, config)
    big = type(config)(**{**config.to_dict(), "hidden_size": 4096, "intermediate_size": 14336,
                          "num_hidden_layers": 32, "vocab_size": 128256})
    from recipes.estimates.memory_estimate import pte_bytes

    assert pte_bytes(big, xnnpack) > DATA_FILE_ABOVE_BYTES
    request.weights_file = None
    assert writes_data_file(xnnpack, request, big)
    request.weights_file = False
    assert not writes_data_file(xnnpack, request, big)


def _live_tensor_bytes(before: frozenset = frozenset()) -> int:
    """Bytes of the live tensors' storages, leaving out those alive at `before` (other tests' session fixtures
    share this process)."""
    storages = {}
    for obj in gc.get_objects():
        if isinstance(obj, torch.Tensor) and not obj.is_meta:
            try:
                storage = obj.untyped_storage()
                storages[storage.data_ptr()] = storage.nbytes()
            except (RuntimeError, NotImplementedError):  # fake or functional tensors own no memory
                continue
    return sum(nbytes for pointer, nbytes in storages.items() if pointer not in before)


def _large_python_buffers(before: frozenset = frozenset()) -> dict:
    """id -> size of the bytes and bytearray objects of at least 64 KiB that a live Python object holds (where
    ExecuTorch keeps a payload before it is written), leaving out the ids in `before`. Read from the objects, not
    from the allocator, so the caches a process happens to fill (source lines, tracing state) do not count."""
    found = {}
    for holder in gc.get_objects():
        for obj in gc.get_referents(holder):
            if isinstance(obj, (bytes, bytearray)) and len(obj) >= 64 << 10 and id(obj) not in before:
                found[id(obj)] = len(obj)
    return found


def _live_storage_pointers() -> frozenset:
    pointers = set()
    for obj in gc.get_objects():
        if isinstance(obj, torch.Tensor) and not obj.is_meta:
            try:
                pointers.add(obj.untyped_storage().data_ptr())
            except (RuntimeError, NotImplementedError):
                continue
    return frozenset(pointers)


def test_serialize_stage_holds_no_packed_weights_in_memory(monkeypatch, tmp_path):
    """At the moment ExecuTorch serializes the program (ExecutorchProgramManager builds the .pte and .ptd), the
    bytes this process holds in tensors and in large Python blocks stay below half the packed weights: the
    payloads are on disk and the quantized source weights were released. Either copy alone would exceed it."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from executorch.exir.program import _program
    from models.llama import build_exportable
    from quant.schemes import apply_scheme
    from recipes.lowering import lower as lowering
    from recipes.registry import get_recipe

    config = LlamaConfig(vocab_size=512, hidden_size=512, intermediate_size=1536, num_hidden_layers=2,
                         num_attention_heads=8, num_key_value_heads=2)
    gc.collect()
    already_alive, buffers_alive = _live_storage_pointers(), frozenset(_large_python_buffers())
    torch.manual_seed(0)
    weights = LlamaForCausalLM(config).state_dict()
    recipe = get_recipe("xnnpack-8da4w")
    module = build_exportable(config, weights, recipe.export_options(64))
    del weights
    apply_scheme(module, "8da4w", group_size=32, algorithm="minmax")
    program = lowering.export_program(module, 64, strict=recipe.backend.strict_export)
    del module
    gc.collect()
    seen = {}
    original = _program.serialize_for_executorch

    def measured(*args, **kwargs):
        gc.collect()
        seen["python_large"] = sum(_large_python_buffers(buffers_alive).values())
        seen["tensors"] = _live_tensor_bytes(already_alive)
        return original(*args, **kwargs)

    monkeypatch.setattr(_program, "serialize_for_executorch", measured)
    lowered = lowering.lower_for_backend(program, recipe, {}, lowering.Lowering(
        pte_path=tmp_path / "model.pte", ptd_path=tmp_path / "model.ptd", consume_program=True))
    packed = lowered.ptd_bytes
    assert packed > 3e6 and seen
    assert seen["python_large"] + seen["tensors"] < packed / 2, (seen, packed)


def _small_llama_program(recipe, tie: bool = False, quantize: bool = True):
    from transformers import LlamaConfig, LlamaForCausalLM

    from models.llama import build_exportable
    from quant.schemes import apply_scheme
    from recipes.lowering import lower as lowering

    config = LlamaConfig(vocab_size=512, hidden_size=512, intermediate_size=1536, num_hidden_layers=2,
                         num_attention_heads=8, num_key_value_heads=2, tie_word_embeddings=tie)
    torch.manual_seed(0)
    module = build_exportable(config, LlamaForCausalLM(config).state_dict(), recipe.export_options(64))
    if quantize:
        apply_scheme(module, "8da4w", group_size=32, algorithm="minmax")
    with torch.no_grad():
        eager = module(torch.tensor([[5, 17, 40, 3, 60, 41]]), torch.tensor([0]))[0].clone()
    return lowering.export_program(module, 64, strict=recipe.backend.strict_export), eager


def test_each_delegates_weights_are_freed_once_packed_and_the_program_is_the_same(monkeypatch, tmp_path):
    """With free_weights_as_packed, once the last delegate is packed the live tensors hold less than a tenth of
    what they hold without it (the quantized weights, each delegate's freed as it was packed), and the .pte and
    .ptd are byte for byte those of a lowering that frees nothing."""
    from recipes.lowering import lower as lowering
    from recipes.registry import get_recipe

    recipe = get_recipe("xnnpack-8da4w")
    live_after_packing = {}
    original = lowering._free_packed

    def measured(edge_program, _mode):
        original(edge_program)
        gc.collect()
        live_after_packing[_mode] = _live_tensor_bytes(already_alive)

    gc.collect()
    already_alive = _live_storage_pointers()
    lowered = {}
    for mode in (False, True):
        program, _ = _small_llama_program(recipe)
        monkeypatch.setattr(lowering, "_free_packed", lambda ep, _mode=mode: measured(ep, _mode))
        folder = tmp_path / str(mode)
        lowered[mode] = lowering.lower_for_backend(program, recipe, {}, lowering.Lowering(
            pte_path=folder / "model.pte", ptd_path=folder / "model.ptd", consume_program=True,
            free_weights_as_packed=mode))
        del program
        gc.collect()
    # two decoder layers' int4 values alone, one byte each, are 6 MB
    assert live_after_packing[False] > 6e6 and live_after_packing[True] < live_after_packing[False] / 10, live_after_packing
    assert (lowered[True].pte_sha256, lowered[True].ptd_sha256) == (lowered[False].pte_sha256, lowered[False].ptd_sha256)


def test_a_weight_also_read_outside_the_delegates_is_not_freed(tmp_path):
    """Tied embeddings in fp32: one weight read by the embedding (outside XNNPACK) and by the output layer (inside).
    Freeing the delegates' weights as they are packed leaves it whole: the runtime computes the eager logits."""
    from recipes.running import generate
    from recipes.lowering import lower as lowering
    from recipes.registry import get_recipe

    recipe = get_recipe("xnnpack-fp32")
    program, eager = _small_llama_program(recipe, tie=True, quantize=False)
    lowering.lower_for_backend(program, recipe, {}, lowering.Lowering(
        pte_path=tmp_path / "model.pte", consume_program=True, free_weights_as_packed=True))
    del program
    _program, method = generate.load_runtime_method(tmp_path / "model.pte", ("executorch.extension.llm.custom_ops.custom_ops",))
    logits = method.execute([torch.tensor([[5, 17, 40, 3, 60, 41]]), torch.tensor([0])])[0]
    assert torch.allclose(logits.reshape(eager.shape), eager, atol=1e-4, rtol=1e-4)
