"""`python -m zoo matrix` on a real local Ray cluster: tiny random Llamas, export only."""
import json

import pytest

TINY = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64, "intermediate_size": 128,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 64,
        "max_position_embeddings": 128, "rms_norm_eps": 1e-5, "tie_word_embeddings": False,
        "bos_token_id": 1, "eos_token_id": 2}


def _entry_file(folder, name, layers):
    path = folder / f"{name}.json"
    path.write_text(json.dumps({"repo_id": f"test/{name}", "license": "apache-2.0", "gated": False,
                                "config": {**TINY, "num_hidden_layers": layers}, "recommended": {}}))
    return str(path)


@pytest.fixture(scope="module")
def ray_cluster():
    ray = pytest.importorskip("ray")
    from zoo.matrix import runtime_env

    ray.init(num_cpus=2, include_dashboard=False, runtime_env=runtime_env(), _memory=6 * 1024**3)
    yield ray
    ray.shutdown()


@pytest.fixture(scope="module")
def tiny_entries(tmp_path_factory):
    folder = tmp_path_factory.mktemp("zoo-entries")
    return [_entry_file(folder, "tiny-a", 1), _entry_file(folder, "tiny-b", 2)]


def _matrix(entries, recipes, out):
    from zoo.matrix import plan_cells, run_matrix
    from zoo.entries import find_entry

    cells = plan_cells([find_entry(e) for e in entries], recipes, max_seq_len=32, generate=False, weights="random")
    return run_matrix(cells, out, log=lambda msg: None)


# A recipe, and one whose group size cannot divide the tiny Llamas' widths: a cell that fails.
RECIPES = ["xnnpack-fp32", "xnnpack-8da4w:group_size=128"]


@pytest.fixture(scope="module")
def first_matrix(ray_cluster, tiny_entries, tmp_path_factory):
    out = tmp_path_factory.mktemp("matrix")
    return out, _matrix(tiny_entries, RECIPES, out)


def _good(cell) -> bool:
    return cell.options.get("group_size") != 128


def test_matrix_of_two_models_by_two_recipes_writes_four_cells(first_matrix):
    from zoo.entries import read_results

    out, result = first_matrix
    written = read_results(out / "results.json")
    assert result["computed"] == 4 and len(written) == 4
    cells = [c for c in written if _good(c)]
    assert {(c.model, c.recipe) for c in cells} == {(m, "xnnpack-fp32") for m in ("test/tiny-a", "test/tiny-b")}
    for cell in cells:
        measured = cell.measured
        assert cell.status == "ok", cell
        assert measured.delegated_percent > 50 and measured.pte_mb > 0 and measured.peak_rss_mb > 0
        assert measured.fidelity == "needs real weights" and measured.perplexity_ratio is None
        assert cell.versions["executorch"] and cell.cpu and cell.date
        assert measured.quant_algorithm is None and "quant_algorithm" in cell.to_dict()  # fp32 takes no int4 algorithm
        assert measured.alone and measured.stages_s["export"] > 0 and cell.task.host_speed.python_mops > 0
    assert (out / "README.md").read_text().count("| test/tiny-") == 2
    assert (out / "heatmap.png").read_bytes()[:4] == b"\x89PNG"


def test_matrix_run_again_recomputes_nothing(first_matrix, tiny_entries):
    out, _ = first_matrix
    again = _matrix(tiny_entries, RECIPES, out)
    assert again["computed"] == 0 and again["skipped"] == 4 and len(again["cells"]) == 4


def test_matrix_records_an_invalid_cell_with_its_reason_and_finishes_the_others(first_matrix):
    _out, result = first_matrix
    bad = [c for c in result["cells"] if not _good(c)]
    assert len(bad) == 2 and all(c.status == "failed" and c.stage == "request" for c in bad)
    assert all("group size 128 does not divide" in c.reason and c.figures is None for c in bad)
    assert sum(c.status == "ok" for c in result["cells"]) == 2


def test_an_earlier_zoo_seeds_a_results_folder_and_a_newer_answer_replaces_the_old(first_matrix, tmp_path):
    """What `--seed-from` does before a matrix run, and what the run's results.json then keeps: the earlier
    cells nobody measured again, and for a question asked again only the latest answer."""
    from dataclasses import replace

    from zoo.cell_result import load_results
    from zoo.matrix import seed_cells, write_results

    earlier, _ = first_matrix
    document = load_results(earlier / "results.json")
    fresh = next(c for c in document.cells if _good(c) and c.model == "test/tiny-a")
    stale = replace(fresh, key="0" * 16, status="refused", stage="memory-estimate", reason="needs ~99 GiB",
                    date="2026-01-01", measured_at="2026-01-01T00:00:00Z")
    other = replace(fresh, key="1" * 16, recipe="xnnpack-8da8w", date="2026-01-01", measured_at=None)
    seeded = tmp_path / "earlier.json"
    seeded.write_text(replace(document, cells=[stale, other]).to_json())
    out = tmp_path / "zoo"
    assert seed_cells(out, seeded) == 2 and seed_cells(out, seeded) == 0  # a cell already there is kept
    (out / "cells" / "tiny-a--xnnpack-fp32--fresh.json").write_text(fresh.to_json())  # as a run writes it
    answers = {c.recipe: c for c in write_results(out)}
    assert set(answers) == {"xnnpack-fp32", "xnnpack-8da8w"}  # the seeded cell nobody measured again stays
    assert answers["xnnpack-fp32"].key == fresh.key and answers["xnnpack-fp32"].status == "ok"
    assert "needs ~99 GiB" not in (out / "README.md").read_text()


def test_matrix_refuses_a_cell_whose_memory_estimate_exceeds_every_node(ray_cluster, tmp_path):
    from zoo.matrix import plan_cells, run_matrix
    from zoo.entries import find_entry

    cells = plan_cells([find_entry("meta-llama/Llama-3.1-8B-Instruct")], ["xnnpack-fp32"], max_seq_len=512,
                       generate=False, weights="random")
    [cell] = run_matrix(cells, tmp_path, log=lambda msg: None)["cells"]
    assert cell.status == "refused" and cell.stage == "memory-estimate" and "GiB" in cell.reason
    assert cell.estimate_gib > 0 and cell.figures is None


def test_every_cell_takes_the_whole_node():
    """Its stages' seconds are the time estimate's rates and its decode's tok/s the zoo's: nothing runs beside it."""
    from zoo.matrix import cell_cpus

    assert cell_cpus(node_cpus=8) == 8 and cell_cpus(node_cpus=2.0) == 2 and cell_cpus(node_cpus=0.5) == 1


