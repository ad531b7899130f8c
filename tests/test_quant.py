"""Quantization schemes (torchao source transforms), the backend x scheme table, group-size checks and
the one-quantization-per-scheme cache."""
import pytest
import torch

from models.errors import UserFacingError
from tests.conftest import run_main

HIDDEN = 64  # the tiny Llama's hidden size

# scheme -> {"linear"/"embedding": (torchao target dtype, block size, dynamic int8 activations)}
EXPECTED = {
    "8da4w": {"linear": (torch.int4, 32, True), "embedding": (torch.int8, HIDDEN, False)},
    "8da4w-emb4": {"linear": (torch.int4, 32, True), "embedding": (torch.int4, HIDDEN, False)},
    "8da8w": {"linear": (torch.int8, "per-channel", True), "embedding": (torch.int8, HIDDEN, False)},
    "int4-weight": {"linear": (torch.int4, 32, False), "embedding": None},
    "int8-weight": {"linear": (torch.int8, "per-channel", False), "embedding": None},
}


def _tiny_module(tiny_checkpoint):
    from models.llama import ExportOptions, build_exportable

    return build_exportable(tiny_checkpoint.config, tiny_checkpoint.state_dict, ExportOptions(32, attention="sdpa"))


def _check_weight(layer, expected):
    weight = layer.weight
    if expected is None:
        assert type(weight) is torch.nn.Parameter and weight.dtype == torch.float32
        return
    dtype, block, dynamic = expected
    assert type(weight).__name__ == "IntxUnpackedToInt8Tensor"
    assert weight.target_dtype == dtype
    assert weight.block_size == (1, weight.shape[1] if block == "per-channel" else block)
    assert (weight.activation_quantization is not None) == dynamic


# An algorithm for the schemes whose default reads the calibration text, which these tests do not pass.
UNCALIBRATED = {"8da4w": "hqq", "8da4w-emb4": "hqq", "int4-weight": "hqq"}


@pytest.mark.parametrize("scheme", sorted(EXPECTED))
def test_scheme_makes_torchao_subclasses(tiny_checkpoint, scheme):
    from quant.schemes import apply_scheme

    module = _tiny_module(tiny_checkpoint)
    apply_scheme(module, scheme, algorithm=UNCALIBRATED.get(scheme))
    linears = [m for m in module.modules() if isinstance(m, torch.nn.Linear)]
    assert len(linears) == 2 * 7 + 1
    for layer in linears:
        _check_weight(layer, EXPECTED[scheme]["linear"])
    _check_weight(module.model.embed_tokens, EXPECTED[scheme]["embedding"])
    logits = module(torch.tensor([[3, 5, 7]]), torch.tensor([0]))
    assert logits.shape[1] == 3 and torch.isfinite(logits).all()


def test_fp16_and_fp32_schemes(tiny_checkpoint):
    from quant.schemes import apply_scheme

    module = _tiny_module(tiny_checkpoint)
    apply_scheme(module, "fp32")
    assert all(type(p) is torch.nn.Parameter and p.dtype == torch.float32 for p in module.parameters())
    apply_scheme(module, "fp16")
    assert all(p.dtype == torch.float16 for p in module.parameters())
    assert module.model.layers[0].self_attn.k_cache.dtype == torch.float16
    assert module(torch.tensor([[3, 5, 7]]), torch.tensor([0])).dtype == torch.float16


def test_every_table_scheme_exists_and_every_recipe_is_in_the_table():
    from quant.schemes import SCHEMES
    from recipes.registry import load_backends

    registry = load_backends()
    for backend in registry.backends.values():
        assert set(backend.schemes) <= set(SCHEMES), (backend.name, set(backend.schemes) - set(SCHEMES))
    for recipe in registry.recipes.values():
        assert recipe.quantization in recipe.backend.schemes, recipe.name


def test_invalid_backend_scheme_is_refused_with_valid_choices(tmp_path):
    from recipes.registry import check_scheme, load_backends

    backends = load_backends().backends
    with pytest.raises(UserFacingError, match="xnnpack takes: fp32, fp16, 8da4w, 8da4w-emb4, 8da8w"):
        check_scheme(backends["xnnpack"], "int8-weight")
    with pytest.raises(UserFacingError, match="coreml takes: fp32, int4-weight, int8-weight"):
        check_scheme(backends["coreml"], "8da4w")
    out = tmp_path / "out"
    result = run_main("run", "--recipe", "xnnpack-int8-weight", "--out", str(out))
    assert result.returncode == 2
    last = result.stderr.strip().splitlines()[-1]
    assert "xnnpack does not take the int8-weight scheme" in last
    assert "xnnpack takes: fp32, fp16, 8da4w, 8da4w-emb4, 8da8w" in last
    assert "loading" not in result.stderr and not out.exists()


def test_a_recipe_option_no_recipe_takes_is_refused_with_the_options_there_are(tmp_path):
    out = tmp_path / "out"
    result = run_main("run", "--recipe", "qnn-16a4w", "--option", "layers_per_shrad=2", "--out", str(out))
    assert result.returncode == 2
    last = result.stderr.strip().splitlines()[-1]
    assert "layers_per_shrad: no recipe takes this option" in last and "layers_per_shard" in last
    assert "loading" not in result.stderr and not out.exists()
    malformed = run_main("run", "--recipe", "qnn-16a4w", "--option", "layers_per_shard", "--out", str(out))
    assert malformed.returncode == 2 and "is not KEY=VALUE" in malformed.stderr and not out.exists()


def test_list_prints_the_compatibility_table():
    result = run_main("list")
    assert result.returncode == 0
    rows = {line.split()[0]: line.split()[1:] for line in result.stdout.splitlines() if line.split()}
    assert rows["scheme"] == ["xnnpack", "coreml", "qnn", "vulkan"]  # the backend that runs here first
    assert rows["8da4w"] == ["yes", "-", "-", "-"] and rows["int4-weight"] == ["-", "yes", "-", "-"]
    assert rows["16a4w"] == ["-", "-", "yes", "-"]
    assert "xnnpack-8da4w-emb4" in rows


def test_group_size_not_offered_is_refused_before_loading(tmp_path):
    from recipes.request import RunRequest
    from recipes.pipeline.run import run

    messages = []
    with pytest.raises(UserFacingError, match="group size 48 is not offered for 8da4w; choose one of: 32, 64, 128, 256"):
        run(RunRequest(recipes=["xnnpack-8da4w"], out_dir=tmp_path / "out", model="/nonexistent",
                       options={"group_size": 48}), progress=lambda f, m: messages.append(m))
    assert messages == []


def test_group_size_that_does_not_divide_is_refused_before_quantizing(tiny_llama_dir, tmp_path):
    from recipes.request import RunRequest
    from recipes.pipeline.run import run

    messages = []
    with pytest.raises(UserFacingError, match=r"group size 128 does not divide .*\(64\).*choose one of: 32, 64\."):
        run(RunRequest(recipes=["xnnpack-8da4w"], out_dir=tmp_path / "out", model=str(tiny_llama_dir),
                       max_seq_len=64, options={"group_size": 128}), progress=lambda f, m: messages.append(m))
    assert messages == ["loading the checkpoint"]
    assert not (tmp_path / "out").exists()


def test_builtin_widths_refuse_group_128():
    from types import SimpleNamespace

    from quant.schemes import check_group_size_fits

    smollm2 = SimpleNamespace(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                              num_attention_heads=9, num_key_value_heads=3, head_dim=64, rms_norm_eps=1e-5,
                              max_position_embeddings=8192)
    check_group_size_fits("8da4w", 32, smollm2)
    with pytest.raises(UserFacingError, match="choose one of: 32, 64"):
        check_group_size_fits("8da4w", 128, smollm2)
    check_group_size_fits("8da8w", 128, smollm2)  # per-channel: no groups to fit


def test_quantization_is_shared_by_backends_with_the_same_scheme(tiny_checkpoint):
    """Two backends taking 8da4w on the same module quantize once; a different group size does not share."""
    from recipes.pipeline.prepare import RecipeJob, Through, prepare_and_lower
    from recipes.registry import Recipe
    from recipes.request import recipe_options
    from recipes.pipeline.stages import Figures, Stages
    from recipes.backends.xnnpack import BACKEND

    def recipe(name, **options):
        return Recipe(name=name, backend=BACKEND, quantization="8da4w", description="", options=options)

    def prepared_for(made, requested, figures):
        job = RecipeJob(made, recipe_options(made, requested), tiny_checkpoint, 32)
        return prepare_and_lower(job, through=Through(stages, figures, prepared))

    prepared, stages = {}, Stages(None, None, total=10)
    first_figures, second_figures, third_figures = Figures(), Figures(), Figures()
    first = prepared_for(recipe("a", group_size=32), {}, first_figures)
    second = prepared_for(recipe("b", group_size=32, soc="SM8650"), {}, second_figures)
    first_timings, second_timings = first_figures.timings.to_dict(), second_figures.timings.to_dict()
    # the quantized module is shared; each recipe gets its own export and lowering (a program lowers only once)
    assert second.module is first.module and second.lowered is not first.lowered
    assert second.lowered.pte == first.lowered.pte
    assert "quantize" in first_timings and "quantize" not in second_timings
    assert second_timings["shared_quantization_with"] == "a" and "export" in second_timings
    third = prepared_for(recipe("c", group_size=32), {"group_size": 64}, third_figures)
    assert third.module is not first.module and "quantize" in third_figures.timings.to_dict()
    assert len(prepared) == 2


def test_new_xnnpack_schemes_lower_and_run(tiny_llama_dir, tmp_path):
    from recipes.request import RunRequest
    from recipes.pipeline.run import run

    summary = run(RunRequest(recipes=["xnnpack-8da4w-emb4", "xnnpack-8da8w", "xnnpack-fp16"], out_dir=tmp_path,
                             model=str(tiny_llama_dir), max_seq_len=64, max_new_tokens=4,
                             prompt="what is the capital ?"))
    sizes = {}
    for report in summary.recipes:
        assert report.errors == [], report.errors
        assert [g.engine for g in report.generations] == ["eager-fp32", "executorch-runtime"]
        assert report.fidelity.engine == "executorch-runtime"
        linear = {o.op: o for o in report.delegation.ops}["aten_linear_default"]
        # per layer: with ExecuTorch's attention ops 5 projections (q/k/v fused) + 1 rope rotation, with aten
        # SDPA (fp16) the 7 projections; in both, 2 norms' mean of squares. Plus the final norm and lm_head.
        per_layer = (5 + 1 if report.recipe.name != "xnnpack-fp16" else 7) + 2
        assert linear.non_delegated == 0 and linear.delegated == 2 * per_layer + 1 + 1
        sizes[report.recipe.name] = report.pte.bytes
    assert sizes["xnnpack-8da4w-emb4"] < sizes["xnnpack-8da8w"] < sizes["xnnpack-fp16"]


def test_two_recipes_sharing_a_quantization_both_lower(tiny_llama_dir, tmp_path):
    """coreml-fp16 and coreml-fp32 share the fp32 module; the second lowering must not reuse a lowered program."""
    from recipes.request import RunRequest
    from recipes.pipeline.run import run

    summary = run(RunRequest(recipes=["coreml-fp16", "coreml-fp32"], out_dir=tmp_path, model=str(tiny_llama_dir),
                             max_seq_len=32, max_new_tokens=3, prompt="what is the capital ?"))
    first, second = summary.recipes
    assert first.errors == [] and second.errors == [], (first.errors, second.errors)
    assert second.timings.shared_quantization_with == "coreml-fp16"
    assert (tmp_path / "coreml-fp16" / "model.pte").exists() and (tmp_path / "coreml-fp32" / "model.pte").exists()
    # coreml-fp16's whole-program delegation is checked here (the built-in model runs coreml-int4 only)
    for report in (first, second):
        delegation = report.delegation
        ops = {o.op: o for o in delegation.ops}
        assert delegation.delegated_subgraphs == 1 and delegation.non_delegated_nodes <= 2
        for op in ("aten_linear_default", "aten_matmul_default", "aten_softmax_int"):  # attention written out
            assert ops[op].delegated > 0 and ops[op].non_delegated == 0, ops[op]


def test_fused_qkv_quantizes_exactly_as_three_linears(tiny_checkpoint):
    """A fused qkv_proj holds q, k and v rows in order; 8da4w's int4 groups run along each
    output row, so the fused linear's output is the three separate quantized linears' outputs, concatenated."""
    from models.llama import ExportOptions, build_exportable
    from quant.schemes import quantize_linears_8da4w

    fused = build_exportable(tiny_checkpoint.config, tiny_checkpoint.state_dict, ExportOptions(32, fuse_qkv=True))
    separate = build_exportable(tiny_checkpoint.config, tiny_checkpoint.state_dict, ExportOptions(32, attention="sdpa"))
    fused_attn, separate_attn = fused.model.layers[0].self_attn, separate.model.layers[0].self_attn
    assert not hasattr(fused_attn, "q_proj") and not hasattr(separate_attn, "qkv_proj")
    x = torch.randn(1, 5, tiny_checkpoint.config.hidden_size)
    quantize_linears_8da4w(fused_attn, 32)
    quantize_linears_8da4w(separate_attn, 32)
    with torch.no_grad():
        expected = torch.cat([separate_attn.q_proj(x), separate_attn.k_proj(x), separate_attn.v_proj(x)], dim=-1)
        assert torch.allclose(fused_attn.qkv_proj(x), expected, atol=1e-5, rtol=0)


def test_8da4w_holds_bf16_scales_and_one_shared_zero_point(tiny_checkpoint):
    """8da4w's int4 linears keep their group scales in bf16 (what XNNPACK's kernels read) with integers rounded
    against those scales, and their all-zero zero points as one broadcast 0; the module computes what it did with
    every zero point stored."""
    from torchao.quantization.quant_primitives import quantize_affine
    from torchao.quantization.quantize_.workflows.intx.intx_unpacked_to_int8_tensor import IntxUnpackedToInt8Tensor

    from quant.schemes import apply_scheme

    module = _tiny_module(tiny_checkpoint)
    floats = {name: m.weight.detach().clone() for name, m in module.named_modules() if isinstance(m, torch.nn.Linear)}
    apply_scheme(module, "8da4w", group_size=32, algorithm="minmax")
    tokens, position = torch.tensor([[3, 5, 7]]), torch.tensor([0])
    with torch.no_grad():
        shared = module(tokens, position).clone()
    linears = {name: m for name, m in module.named_modules() if isinstance(m, torch.nn.Linear)}
    assert linears
    for name, linear in linears.items():
        weight = linear.weight
        assert isinstance(weight, IntxUnpackedToInt8Tensor) and weight.scale.dtype == torch.bfloat16, name
        assert weight.zero_point.untyped_storage().nbytes() == 1 and not weight.zero_point.any(), name
        expected = quantize_affine(floats[name], weight.block_size, weight.scale, weight.zero_point, torch.int8, -8, 7)
        assert torch.equal(weight.qdata, expected), name
        weight.zero_point = weight.zero_point.contiguous()  # every group's zero point stored, as torchao makes them
    with torch.no_grad():
        assert torch.equal(module(tokens, position), shared)
