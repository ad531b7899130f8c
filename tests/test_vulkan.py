"""Vulkan, the backend added as one file (recipes/backends/vulkan.py): the tiny Llama lowers with its linears (as mm after
to_edge) and attention delegated; the .pte does not run on the wheel's runtime, so the column
shows the eager generation, labelled, with the reason."""
import pytest

from recipes.output.report import DelegatedOp

LINEARS_PER_LAYER = 6  # fused q/k/v, o, gate, up, down, and the rope rotation (a product with a constant matrix)


def _mm(report) -> DelegatedOp:
    return {o.op: o for o in report.delegation.ops}["aten_mm_default"]


@pytest.fixture(scope="module")
def vulkan_run(tiny_llama_dir, tmp_path_factory):
    """The tiny Llama through run() with vulkan-fp32 and vulkan-fp16: (out folder, summary)."""
    from recipes.request import RunRequest
    from recipes.pipeline.run import run

    out = tmp_path_factory.mktemp("vulkan")
    return out, run(RunRequest(recipes=["vulkan-fp32", "vulkan-fp16"], out_dir=out, model=str(tiny_llama_dir),
                               max_seq_len=32, max_new_tokens=3, prompt="what is the capital ?"))


def test_tiny_llama_lowers_with_vulkan_and_shows_the_labelled_eager_generation(vulkan_run):
    tmp_path, summary = vulkan_run
    for report in summary.recipes:
        assert report.errors == [], report.errors
        mm = _mm(report)
        assert mm.delegated == 2 * LINEARS_PER_LAYER + 1 and mm.non_delegated == 0, mm
        custom_sdpa = {o.op: o for o in report.delegation.ops}["llama_custom_sdpa_default"]
        assert custom_sdpa.non_delegated == 0
        assert report.delegation.delegated_subgraphs <= 2
        outside = {o.op for o in report.delegation.ops if o.non_delegated}
        assert outside <= {"aten_index_select_default", "aten_arange_start_step", "sym_size", "getitem"}, outside
        assert [g.engine for g in report.generations] == ["eager-fp32", "eager-quantized"]
        assert "no Vulkan backend" in report.runtime_note
        pte = (tmp_path / report.recipe.name / "model.pte").read_bytes()
        assert b"VulkanBackend" in pte and len(pte) == report.pte.bytes
    assert summary.recipes[1].timings.shared_quantization_with == "vulkan-fp32"


def test_vulkan_pte_on_the_wheels_runtime_says_where_it_runs(vulkan_run):
    from models.errors import UserFacingError
    from recipes.running.generate import load_runtime_method

    out, _summary = vulkan_run
    with pytest.raises(UserFacingError, match="VulkanBackend programs run on devices with a Vulkan 1.1 GPU"):
        load_runtime_method(out / "vulkan-fp32" / "model.pte")
