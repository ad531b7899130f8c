"""The per-op profile of a .pte on the ExecuTorch runtime (ETDump + Inspector), its ETRecord, and the
profile's place in report.json and in the app."""
import pytest

from recipes.running import profile


@pytest.fixture(scope="module")
def tiny_profiled_run(tmp_path_factory):
    """A random 2-layer Llama through run() with xnnpack-fp32 (runs here) and coreml-fp16 (cannot, off macOS).
    Hidden 512: wide enough that a step's runtime, not the Python call around it, makes most of its time."""
    from recipes.request import RunRequest
    from recipes.pipeline.run import run
    from tests.conftest import _random_llama_dir

    model = _random_llama_dir(tmp_path_factory, "profiled-llama", hidden=512, intermediate=1024, layers=2)
    out = tmp_path_factory.mktemp("tiny-profiled-run")
    summary = run(RunRequest(recipes=["xnnpack-fp32", "coreml-fp16"], out_dir=out, model=str(model),
                             prompt="the capital of France is", max_new_tokens=8, max_seq_len=64, etrecord=True))
    return out, {r.recipe.name: r for r in summary.recipes}


def _profiled(report):
    # The pinned executorch wheel's runtime has its event tracer: a null profile is a failure, not a skip.
    assert report.profile is not None, report.profile_note
    return report.profile


def test_xnnpack_profile_has_delegated_xnnpack_ops_and_kv_cache_ops_outside(tiny_profiled_run):
    out, reports = tiny_profiled_run
    report = reports["xnnpack-fp32"]
    found = _profiled(report)
    assert found.engine == "executorch-runtime"
    decode = found.decode
    generated = report.generations[-1]
    assert decode.steps == generated.new_tokens - 1 and found.prefill.steps == 1
    ops = {row.op: row for row in decode.ops}
    gemm = [row for row in decode.ops if row.delegated and "Fully Connected" in row.op]
    assert gemm and all(row.backend == "XnnpackBackend" for row in gemm)
    for kv_cache_op in ("llama::update_cache.out", "llama::custom_sdpa.out"):
        assert ops[kv_cache_op].delegated is False and ops[kv_cache_op].backend is None
    assert ops["llama::update_cache.out"].count == 2 * 2  # keys and values, two layers
    assert sum(row.ms_per_step for row in decode.ops) == pytest.approx(decode.step_ms, rel=0.01)
    assert sum(row.percent_of_step for row in decode.ops) == pytest.approx(100, abs=1)
    assert 0 < decode.outside_delegates_percent < 100
    # A check of the parse, not a timing target: the runtime's step against the same calls timed from Python.
    assert decode.step_p50_ms == pytest.approx(decode.measured_p50_ms, rel=0.3)
    assert found.load.load_method_ms > 0 and found.load.method_init_ms > 0
    assert found.files.to_dict() == {"etdump": "model.etdump", "prefill_etdump": "prefill.etdump",
                                     "etrecord": "etrecord.bin"}
    folder = out / "xnnpack-fp32"
    assert all((folder / name).stat().st_size > 0 for name in found.files.to_dict().values())


def test_etrecord_and_etdump_load_back_with_inspector(tiny_profiled_run):
    from executorch.devtools import Inspector, parse_etrecord

    out, reports = tiny_profiled_run
    folder = out / "xnnpack-fp32"
    etrecord = parse_etrecord(str(folder / profile.ETRECORD_NAME))
    assert etrecord.edge_dialect_program is not None and etrecord._delegate_map
    _profiled(reports["xnnpack-fp32"])
    inspector = Inspector(etdump_path=str(folder / profile.ETDUMP_NAME), etrecord=etrecord)
    events = [e for block in inspector.event_blocks for e in block.events]
    assert any(e.is_delegated_op and e.delegate_backend_name == "XnnpackBackend" for e in events)
    delegate_calls = [e for e in events if e.name == profile.DELEGATE_CALL]
    assert delegate_calls and any("aten.linear.default" in e.op_types for e in delegate_calls)


def test_recipe_that_cannot_run_here_has_a_null_profile_with_the_reason(tiny_profiled_run):
    import platform

    if platform.system() == "Darwin":
        pytest.skip("the Core ML runtime exists on macOS")
    out, reports = tiny_profiled_run
    report = reports["coreml-fp16"]
    assert report.errors == [] and report.pte is not None
    assert report.profile is None
    assert "does not run here" in report.profile_note and "Apple" in report.profile_note
    assert not (out / "coreml-fp16" / profile.ETDUMP_NAME).exists()


def test_app_frames_show_the_decode_step_top_ops_and_filter_the_table(tiny_profiled_run):
    from recipes.output import profile_view

    out, reports = tiny_profiled_run
    _profiled(reports["xnnpack-fp32"])
    rows = profile_view.profile_rows(list(reports.values()))
    bars = profile_view.decode_bars(rows, top=3)
    assert list(bars.columns) == profile_view.BAR_COLUMNS and len(bars) == 4
    assert bars["op"].iloc[-1] == profile_view.OTHER_OPS
    assert {"delegated", "not delegated"} >= set(bars["kind"].iloc[:3])
    table = profile_view.profile_table(rows, "coreml")
    assert table.empty and list(table.columns) == profile_view.TABLE_COLUMNS
    table = profile_view.profile_table(rows, "xnnpack-fp32")
    assert set(table["phase"]) == {"decode", "prefill"} and table["delegated"].any() and not table["delegated"].all()
    summary = profile_view.profile_summary(list(reports.values()))
    assert "coreml-fp16**: no profile" in summary and "outside delegates" in summary
    from recipes.output.publish import model_card

    assert "Where a decode step's time goes" in model_card(reports["xnnpack-fp32"])
    assert "Where a decode step's time goes" not in model_card(reports["coreml-fp16"])


def test_no_profile_leaves_the_folder_without_etdump_or_etrecord(tiny_llama_dir, tmp_path):
    from recipes.request import RunRequest
    from recipes.pipeline.run import run

    summary = run(RunRequest(recipes=["xnnpack-fp32"], out_dir=tmp_path, model=str(tiny_llama_dir),
                             prompt="the capital of France is", max_new_tokens=2, max_seq_len=32, profile=False,
                             generate=False))
    report = summary.recipes[0]
    assert report.pte is not None and report.profile is None and "--no-profile" in report.profile_note
    names = {p.name for p in tmp_path.iterdir()}
    assert {"model.pte", "report.json"} <= names and not names & {"etrecord.bin", "model.etdump", "prefill.etdump"}


def test_program_table_is_read_from_the_flatbuffer_alone(tiny_profiled_run, tmp_path):
    """The profile names instructions from the flatbuffer before the segments, never loading the payloads: a
    .pte cut right after its flatbuffer gives the same plan as ExecuTorch's whole-file deserializer."""
    from executorch.exir._serialize._program import _get_extended_header, deserialize_pte_binary

    from recipes.files.pte_program import read_program

    out, _ = tiny_profiled_run
    data = (out / "xnnpack-fp32" / "model.pte").read_bytes()
    header = _get_extended_header(data)
    assert header is not None and header.segment_base_offset > 0
    assert header.program_size < len(data) / 10  # the segments are most of the file
    cut = tmp_path / "flatbuffer-only.pte"
    cut.write_bytes(data[:header.program_size])
    whole = deserialize_pte_binary(data).program.execution_plan[0]
    table = read_program(cut).execution_plan[0]
    assert table.operators == whole.operators
    assert [d.id for d in table.delegates] == [d.id for d in whole.delegates]
    assert {d.id for d in table.delegates} == {"XnnpackBackend"}
    assert [type(i.instr_args) for c in table.chains for i in c.instructions] == \
        [type(i.instr_args) for c in whole.chains for i in c.instructions]
    assert profile.instruction_names(cut) == profile.instruction_names(out / "xnnpack-fp32" / "model.pte")
