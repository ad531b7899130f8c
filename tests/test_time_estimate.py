"""The job's time before it runs: rates fitted to the zoo's measured cells (zoo/time_estimate.py)."""
import json

import pytest

from recipes.job_cost import recipe_options_for
from recipes.registry import get_recipe
from zoo.entries import load_entries, read_results
from zoo.time_estimate import estimate_time, fit_power_law, part_fit, size_label

# One finished export-only cell per backend on executorch 1.5.1, all among the cells the fit reads.
CELLS = {"2b7f2b9604fe47e2": "xnnpack-8da8w at Llama-3.2-1B", "42c9f1ddb425b6ef": "coreml-int4 at SmolLM2-1.7B",
         "1407e41e78d35de3": "qnn-16a4w at Llama-3.2-1B"}


@pytest.mark.parametrize("key", CELLS)
def test_the_estimate_is_within_half_of_a_measured_cell(key):
    from recipes.memory_estimate import parameter_count

    cell = next(c for c in read_results() if c["key"] == key)
    recipe = get_recipe(cell["recipe"])
    params = parameter_count(load_entries()[cell["model"]].llama_config())
    estimate = estimate_time(params, [recipe], recipe_options_for([recipe], cell["options"]), not cell["export_only"])
    print(f"{CELLS[key]}: estimated {estimate.seconds:.0f} s, measured {cell['seconds']:.0f} s")
    assert 0.5 <= estimate.seconds / cell["seconds"] <= 1.5
    assert estimate.smallest < params <= estimate.largest and size_label(estimate.smallest) == "134M"
    assert estimate.cores == (2,)


def test_a_power_law_is_fitted_back_exactly():
    points = [(params, 30 * (params / 1e9) ** 0.8) for params in (1e8, 5e8, 3e9)]
    scale, exponent = fit_power_law(points)
    assert scale == pytest.approx(30) and exponent == pytest.approx(0.8)
    assert fit_power_law([(1e8, 50.0), (1e9, 20.0)])[1] == 0  # a bigger model never takes less time


def cell(params: int, seconds: float, algorithm: str | None, export_only: bool = True) -> dict:
    return {"key": f"{params}-{algorithm}", "model": "m", "recipe": "xnnpack-8da4w", "backend": "xnnpack",
            "params": params, "options": {"group_size": 32}, "export_only": export_only, "status": "ok",
            "versions": {"executorch": "1.5.1"}, "cores": 2, "quant_algorithm": algorithm,
            "export_s": 10.0, "lower_s": 60.0, "seconds": 70.0 + seconds}


def test_cells_that_record_the_algorithm_time_it_apart_and_the_others_say_so(tmp_path):
    results = tmp_path / "results.json"
    cells = [cell(int(1e8), 30, "hqq"), cell(int(1e9), 60, "hqq"), cell(int(1e8), 300, "awq"), cell(int(1e9), 3000, "awq")]
    results.write_text(json.dumps({"cells": cells}))
    recipe = get_recipe("xnnpack-8da4w")

    def seconds(algorithm):
        options = recipe_options_for([recipe], {"quant_algorithm": algorithm})
        return estimate_time(int(1e9), [recipe], options, generate=False, path=results)

    assert seconds("awq").recipes[0].seconds["other"] == pytest.approx(3000)
    assert seconds("hqq").recipes[0].seconds["other"] == pytest.approx(60)
    assert part_fit("other", "xnnpack", "8da4w", "awq", True, results).group == ("xnnpack", "8da4w", "awq", True)
    minmax = seconds("minmax")  # no cell ran it: the scheme's cells of every algorithm, and a note
    assert "no zoo cell records the minmax algorithm for 8da4w" in " ".join(minmax.notes)
    assert not seconds("awq").notes


def test_a_search_no_cell_recorded_is_added_at_its_measured_rate(tmp_path):
    """Cells that do not record their algorithm quantized without a search: AWQ's is added to its estimate."""
    from zoo.time_estimate import SEARCH_S_PER_BILLION

    results = tmp_path / "results.json"
    results.write_text(json.dumps({"cells": [cell(int(1e8), 30, None), cell(int(1e9), 60, None)]}))
    recipe = get_recipe("xnnpack-8da4w")

    def estimate(algorithm):
        options = recipe_options_for([recipe], {"quant_algorithm": algorithm})
        return estimate_time(int(2e9), [recipe], options, generate=False, path=results)

    hqq, awq = estimate("hqq"), estimate("awq")
    assert awq.recipes[0].seconds["other"] - hqq.recipes[0].seconds["other"] == pytest.approx(
        2 * SEARCH_S_PER_BILLION["awq"])
    assert "calibration search" in " ".join(awq.notes) and "calibration search" not in " ".join(hqq.notes)
