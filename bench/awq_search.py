"""AWQ's search plans (quant/awq.py) side by side, in one process so each figure has its peers from the same run:

    python -m bench.awq_search kl               # the built-in model's eager xnnpack-8da4w module: search s, mean KL
    python -m bench.awq_search time llama-3.2-1b  # one decoder layer at a published shape: search s per layer
    python -m bench.awq_search memory llama-3.1-8b  # the same layer: each plan's peak RSS over the layer

`kl` scores each plan's module against the fp32 reference on the evaluation and held-out texts (recipes/fidelity.py),
as a job's fidelity does on the .pte. `time` builds one random decoder layer with the shape's config
(bench/scale_models.py), carries 512 random calibration tokens into it, and times each plan's search on its own
copy of that layer. `memory` measures, on the same layer, the peak RSS each plan's search adds to what the process
held before it (recipes/rss.py), in fp32 copies of the widest linear group (gate and up): the unit the memory
estimate counts (quant/awq.py: AWQ_SEARCH_COPIES). Prints one JSON line per plan."""
from __future__ import annotations

import copy
import importlib
import json
import os
import sys
import time

import torch
from transformers import LlamaConfig

from bench.scale_models import CONFIGS
from models.checkpoint import load_checkpoint
from models.llama import ExportOptions, LlamaForExport, _fill_buffers, build_exportable
from quant.awq import EXHAUSTIVE, FAST, AwqAsBuilt, SearchPlan, _entering_first_layer, search_layer
from quant.calibration import calibration_windows
from quant.schemes import apply_scheme_by_rows, search_config
from recipes import fidelity, rss
from recipes.generate import eager_step
from recipes.registry import get_recipe

MAX_SEQ_LEN = 512
RECIPE = "xnnpack-8da4w"
# Each lever added to the one before, then the default with one lever changed.
PLANS = {
    "exhaustive (torchao's AWQObserver)": EXHAUSTIVE,
    "plain tensors, unscaled output once": SearchPlan(token_stride=1, coarse_step=1, mlp_block=False,
                                                      bf16_products=False),
    "+ every 4th token": SearchPlan(token_stride=4, coarse_step=1, mlp_block=False, bf16_products=False),
    "+ coarse grid, refined": SearchPlan(token_stride=4, coarse_step=4, mlp_block=False, bf16_products=False),
    "+ gate/up on the MLP's output": SearchPlan(bf16_products=False),
    "+ products in bf16 (default)": FAST,
    "default, every token": SearchPlan(token_stride=1),
    "default, every 8th token": SearchPlan(token_stride=8),
    "default, every 16th token": SearchPlan(token_stride=16),
    "default, all 20 candidates": SearchPlan(coarse_step=1),
}


def _line(**figures) -> None:
    print(json.dumps({**figures, "load_average": os.getloadavg()[0]}), flush=True)


def mean_kl() -> None:
    checkpoint = load_checkpoint(None)
    ids = [fidelity.eval_token_ids(checkpoint.tokenizer, text) for text in (fidelity.EVAL_TEXT, fidelity.HELDOUT_TEXT)]
    reference = build_exportable(checkpoint.config, checkpoint.state_dict, ExportOptions(MAX_SEQ_LEN, attention="sdpa"),
                                 tie_output=True)
    scored = [fidelity.score_text(eager_step(reference), text, MAX_SEQ_LEN) for text in ids]
    del reference
    windows = calibration_windows(checkpoint.tokenizer, MAX_SEQ_LEN)
    for name, plan in PLANS.items():
        search, spent = AwqAsBuilt(search_config("8da4w"), windows, plan), [0.0]

        def transform(unit, module):
            started = time.perf_counter()
            search(unit, module)
            spent[0] += time.perf_counter() - started
            apply_scheme_by_rows(unit, "8da4w", None, algorithm="awq")

        module = build_exportable(checkpoint.config, checkpoint.state_dict,
                                  get_recipe(RECIPE).export_options(MAX_SEQ_LEN), transform_unit=transform)
        figures = [fidelity.compare_step(eager_step(module), s.ids, MAX_SEQ_LEN, s.logits, s.targets) for s in scored]
        _line(plan=name, search_s=round(spent[0], 1), mean_kl=round(figures[0]["mean_kl"], 4),
              heldout_mean_kl=round(figures[1]["mean_kl"], 4),
              perplexity_ratio=round(figures[0]["perplexity_ratio"], 3))


def _random_layer_and_states(shape: str):
    importlib.import_module("executorch.extension.llm.custom_ops.custom_ops")  # the layer's cache and SDPA ops
    torch.manual_seed(0)
    config = LlamaConfig(**{**CONFIGS[shape], "num_hidden_layers": 1})
    options = get_recipe(RECIPE).export_options(MAX_SEQ_LEN)
    module = LlamaForExport(config, options).eval()
    with torch.no_grad():
        for name, parameter in module.named_parameters():
            parameter.fill_(1.0) if "norm" in name else parameter.normal_(0, config.initializer_range)
    _fill_buffers(module, config, options)
    states, arguments = _entering_first_layer(module, [torch.randint(0, config.vocab_size, (1, MAX_SEQ_LEN))])
    return config, module, states, arguments


def layer_time(shape: str) -> None:
    config, module, states, arguments = _random_layer_and_states(shape)
    for name, plan in PLANS.items():
        layer = copy.deepcopy(module.model.layers[0])
        started = time.perf_counter()
        search_layer(layer, states, arguments, search_config("8da4w"), plan)
        _line(plan=name, shape=shape, search_s_per_layer=round(time.perf_counter() - started, 2),
              layers=CONFIGS[shape]["num_hidden_layers"])


def layer_memory(shape: str) -> None:
    config, module, states, arguments = _random_layer_and_states(shape)
    widest_bytes = 4 * config.hidden_size * 2 * config.intermediate_size
    # the default first: a plan measured after another may reuse heap the other freed, and read low
    for name, plan in {"default": FAST, "exhaustive (torchao's AWQObserver)": EXHAUSTIVE}.items():
        layer = copy.deepcopy(module.model.layers[0])
        before = rss.rss_bytes()
        rss.mark()
        search_layer(layer, states, arguments, search_config("8da4w"), plan)
        added = rss.peak_bytes() - before
        _line(plan=name, shape=shape, peak_over_layer_mb=round(added / 2**20), widest_group_mb=round(widest_bytes / 2**20),
              copies=round(added / widest_bytes, 2))
        del layer


if __name__ == "__main__":
    modes = {"kl": lambda: mean_kl(), "time": lambda: layer_time(sys.argv[2]), "memory": lambda: layer_memory(sys.argv[2])}
    modes[sys.argv[1]]()
