"""A checkpoint checked against itself before anything heavy runs: the config's numbers against each other, every
tensor against the config (names, layer count, shapes, dtypes, a tied or separate output layer), and the ids the
tokenizer and generation config can produce against the vocabulary. Each mismatch is one UserFacingError naming
the field or tensor, what was expected, and what to do: nothing later meets a checkpoint that disagrees with
itself."""
from __future__ import annotations

import re
from collections.abc import Mapping

import torch

from models.errors import UserFacingError
from models.llama import checkpoint_tensors
from models.rope import rope_frequencies

# Activations Hugging Face's Llama computes as SiLU (transformers' ACT2FN): the only one the module computes.
SILU_NAMES = ("silu", "swish")
FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)
FLOAT_FILE_DTYPES = ("F32", "F16", "BF16", "F64")  # the same, as safetensors names them
# Rows of the embedding and a separate output layer compared when the config ties them: a checkpoint that ties
# its output layer stores the same matrix twice, so rows that differ anywhere show a separate layer.
TIE_SAMPLE_ROWS = 8
LAYER_NAME = re.compile(r"model\.layers\.(\d+)\.")
REFETCH = "download or convert the checkpoint again, or use the config.json that came with these weights"


def check_config_sizes(config, where: str) -> None:
    """The config's sizes are positive whole numbers that fit together as the module reads them."""
    sizes = {name: getattr(config, name, None) for name in
             ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
              "max_position_embeddings")}
    sizes["num_key_value_heads"] = getattr(config, "num_key_value_heads", None) or sizes["num_attention_heads"]
    for name, value in sizes.items():
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise UserFacingError(f"{where}: config.json's {name} is {value!r}; it must be a whole number of at "
                                  f"least 1. Fix config.json ({REFETCH}).")
    heads, kv_heads = sizes["num_attention_heads"], sizes["num_key_value_heads"]
    if heads % kv_heads:
        raise UserFacingError(f"{where}: config.json's num_attention_heads ({heads}) is not a multiple of "
                              f"num_key_value_heads ({kv_heads}): each key/value head must serve a whole group of "
                              f"query heads. Fix config.json ({REFETCH}).")
    head_dim = getattr(config, "head_dim", None) or sizes["hidden_size"] // heads
    if not isinstance(head_dim, int) or head_dim < 2 or head_dim % 2:
        raise UserFacingError(f"{where}: config.json's head_dim is {head_dim!r}; rotary embeddings need an even "
                              f"head size of at least 2. Fix config.json ({REFETCH}).")
    eps = getattr(config, "rms_norm_eps", None)
    if not isinstance(eps, (int, float)) or isinstance(eps, bool) or not eps > 0:
        raise UserFacingError(f"{where}: config.json's rms_norm_eps is {eps!r}; it must be a positive number, "
                              f"e.g. 1e-05. Fix config.json ({REFETCH}).")
    activation = getattr(config, "hidden_act", "silu")
    if activation not in SILU_NAMES:
        raise UserFacingError(f"{where}: config.json's hidden_act is {activation!r}; a Llama's MLP computes SiLU "
                              f"({', '.join(SILU_NAMES)}), and Lowerbench would compute this model wrong.")
    try:
        rope_frequencies(config)
    except Exception as err:  # transformers raises KeyError, ValueError or TypeError for a rope it cannot build
        raise UserFacingError(f"{where}: config.json's rotary embedding settings cannot be built "
                              f"({type(err).__name__}: {err}); fix rope_parameters / rope_scaling in config.json "
                              f"({REFETCH}).") from None


def check_tensors(config, weights: Mapping[str, torch.Tensor], where: str) -> None:
    """Every tensor the module reads is there, of the config's shape and a float dtype, and nothing else is; an
    output layer stored beside an embedding the config ties it to is the same matrix."""
    expected = checkpoint_tensors(config)
    present = {name for name in weights if not name.endswith("rotary_emb.inv_freq")}
    tied = bool(getattr(config, "tie_word_embeddings", False))
    if "lm_head.weight" not in present:
        if not tied:
            raise UserFacingError(f"{where} has no lm_head.weight, and config.json unties the output layer from the "
                                  "embedding (tie_word_embeddings false): set tie_word_embeddings to true if the "
                                  "model shares its embedding as output layer, or download the missing tensor.")
        del expected["lm_head.weight"]
    _check_layer_count(config, present, where)
    missing = [name for name in expected if name not in present]
    if missing:
        more = f" and {len(missing) - 1} more" if len(missing) > 1 else ""
        raise UserFacingError(f"{where} has no tensor {missing[0]}{more}, which config.json's Llama needs: "
                              f"{REFETCH}.")
    unexpected = sorted(present - set(expected))
    if unexpected:
        more = f" and {len(unexpected) - 1} more" if len(unexpected) > 1 else ""
        raise UserFacingError(f"{where} has a tensor {unexpected[0]}{more} that config.json's Llama does not read "
                              f"(a bias, another architecture's or a quantized checkpoint's tensor): {REFETCH}.")
    for name, shape in expected.items():
        stored = _shape(weights, name)
        if stored != shape:
            raise UserFacingError(f"{where}: {name} is {list(stored)}, config.json's sizes make it {list(shape)}: "
                                  f"{REFETCH}.")
        stored_as = _float_or_stored_dtype(weights, name)
        if stored_as is not None:
            raise UserFacingError(f"{where}: {name} is stored as {stored_as}; Lowerbench reads float weights (fp32, "
                                  "fp16, bf16). A pre-quantized checkpoint cannot be quantized again: give its float "
                                  "original.")
    if tied and "lm_head.weight" in present and not _same_rows(weights, "lm_head.weight", "model.embed_tokens.weight"):
        raise UserFacingError(f"{where}: config.json ties the output layer to the embedding (tie_word_embeddings "
                              "true), but lm_head.weight differs from model.embed_tokens.weight; set "
                              "tie_word_embeddings to false to use lm_head.weight, or remove lm_head.weight.")


def check_token_ids(config, tokenizer, eos_token_ids: tuple[int, ...], where: str) -> None:
    """Every id the tokenizer can produce, and every stop id, has a row in the embedding."""
    vocab = config.vocab_size
    largest = max(tokenizer.get_vocab().values(), default=-1)
    if largest >= vocab:
        raise UserFacingError(f"{where}: the tokenizer has token id {largest}, but config.json's vocab_size is "
                              f"{vocab}: the tokenizer does not belong to this model. Use the tokenizer files that "
                              "came with these weights.")
    named = {"bos_token_id": getattr(config, "bos_token_id", None)}
    named.update({"eos_token_id": i for i in eos_token_ids})
    for field, value in named.items():
        if isinstance(value, int) and not isinstance(value, bool) and not 0 <= value < vocab:
            raise UserFacingError(f"{where}: the {field} {value} is outside the vocabulary (vocab_size {vocab}); "
                                  "fix config.json or generation_config.json.")


def _check_layer_count(config, present: set[str], where: str) -> None:
    layers = {int(match.group(1)) for name in present if (match := LAYER_NAME.match(name))}
    wanted = config.num_hidden_layers
    if layers and max(layers) + 1 != wanted:
        raise UserFacingError(f"{where} holds tensors of {max(layers) + 1} decoder layers (model.layers.0 to "
                              f"model.layers.{max(layers)}), config.json's num_hidden_layers says {wanted}: {REFETCH}.")


def _shape(weights, name: str) -> tuple[int, ...]:
    shape = getattr(weights, "shape", None)
    return tuple(shape(name)) if shape is not None else tuple(weights[name].shape)


def _float_or_stored_dtype(weights, name: str) -> str | None:
    """None for a float tensor, else the dtype it is stored as (the file's own name where torch has none)."""
    dtype_name = getattr(weights, "dtype_name", None)
    if dtype_name is not None:
        return None if dtype_name(name) in FLOAT_FILE_DTYPES else dtype_name(name)
    dtype = weights[name].dtype
    return None if dtype in FLOAT_DTYPES else str(dtype).replace("torch.", "")


def _same_rows(weights, first: str, second: str) -> bool:
    """Whether two matrices of one shape agree on rows spread over their height."""
    height = _shape(weights, first)[0]
    rows = sorted({round(i * (height - 1) / max(1, TIE_SAMPLE_ROWS - 1)) for i in range(TIE_SAMPLE_ROWS)})
    sample = getattr(weights, "rows", None)
    if sample is not None:
        return torch.equal(sample(first, rows), sample(second, rows))
    return torch.equal(weights[first][rows], weights[second][rows])
