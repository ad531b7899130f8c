"""The metadata methods ExecuTorch's LLM runners read from a .pte, as constant methods of the program.
Names and types are those of executorch 1.5.1's extension/llm/runner (constants.h, llm_runner_helper.cpp):
TextLLMRunner refuses a .pte without get_max_seq_len and, for the others, falls back to defaults
(max context 128, no dynamic shape) that do not fit our programs. Facts about the program come from the
ExportedProgram itself; the rest from the checkpoint's config, tokenizer and generation config."""
from __future__ import annotations

import torch

# The custom ops whose attention reads the KV cache in place (export_llama's use_sdpa_with_kv_cache).
_CACHE_SDPA_OPS = ("llama::custom_sdpa", "llama::custom_quantized_sdpa", "llama::sdpa_with_kv_cache")


def _tokens_length(program: torch.export.ExportedProgram):
    tokens = next(n for n in program.graph.nodes if n.op == "placeholder" and n.name in _user_inputs(program))
    return tokens.meta["val"].shape[1]


def token_dimension_is_dynamic(program: torch.export.ExportedProgram) -> bool:
    return not isinstance(_tokens_length(program), int)


def tokens_per_call(program: torch.export.ExportedProgram) -> int:
    """The most tokens one call takes: the token dimension's upper bound, or its fixed size."""
    length = _tokens_length(program)
    if isinstance(length, int):
        return length
    return int(program.range_constraints[length.node.expr].upper)


def uses_ring_cache(program: torch.export.ExportedProgram) -> bool:
    """The program writes its cache through row indices (a ring, models/llama.py kv_window), so it takes any
    position rather than stopping at the cache's length."""
    return any(getattr(getattr(n.target, "_schema", None), "name", "") == "llama::update_cache_with_indices"
               for n in program.graph.nodes if n.op == "call_function")


def uses_kv_cache(program: torch.export.ExportedProgram) -> bool:
    """The program takes a position (the runner's own test: more than one input) and writes a buffer it
    keeps between calls, in place (an exported program keeps in-place ops until it is functionalized)."""
    return len(_user_inputs(program)) > 1 and (bool(program.graph_signature.buffers_to_mutate)
                                               or bool(_written_buffers(program)))


def _written_buffers(program: torch.export.ExportedProgram) -> set[str]:
    buffers = set(program.graph_signature.inputs_to_buffers)
    written = set()
    for node in program.graph.nodes:
        schema = getattr(node.target, "_schema", None)
        if node.op != "call_function" or schema is None:
            continue
        for argument, value in zip(schema.arguments, node.args):
            if argument.alias_info is not None and argument.alias_info.is_write:
                while isinstance(value, torch.fx.Node) and value.op == "call_function" and value.args:
                    value = value.args[0]  # through views (slice, select, ...) to the tensor they view
                if isinstance(value, torch.fx.Node) and value.name in buffers:
                    written.add(value.name)
    return written


def uses_cache_sdpa(program: torch.export.ExportedProgram) -> bool:
    for node in program.graph.nodes:
        name = getattr(getattr(node.target, "_schema", None), "name", "")
        if node.op == "call_function" and name in _CACHE_SDPA_OPS:
            return True
    return False


def logits_width(program: torch.export.ExportedProgram) -> int:
    output = next(n for n in program.graph.nodes if n.op == "output")
    user_outputs = [o for o in output.args[0] if o.name in program.graph_signature.user_outputs]
    return int(user_outputs[0].meta["val"].shape[-1])


def _user_inputs(program: torch.export.ExportedProgram) -> list[str]:
    return list(program.graph_signature.user_inputs)


def llm_metadata(program: torch.export.ExportedProgram, max_context_len: int, config, tokenizer,
                 eos_token_ids) -> dict[str, int | bool | list[int]]:
    """The constant methods for `to_edge_transform_and_lower(constant_methods=...)`. `max_context_len` is the
    length of the module's KV cache. get_max_seq_len is the most tokens one call takes: the token dimension's
    upper bound for a dynamic program (TextLLMRunner prefills a longer prompt in calls of that many) and, as
    export_llama writes it, the cache length for a static one (the runner then prefills token by token, because
    enable_dynamic_shape is False). get_max_context_len is how far positions go: the cache length, or for a
    ring the model's max_position_embeddings, every attended distance staying within the ring. A program that
    takes fewer tokens per call than its context is what executorch 1.5.1's TextLLMRunner treats as a sliding
    window: it caps each generate() call at the context rather than the whole conversation."""
    bos = tokenizer.bos_token_id if isinstance(tokenizer.bos_token_id, int) else getattr(config, "bos_token_id", None)
    dynamic = token_dimension_is_dynamic(program)
    if uses_ring_cache(program):
        max_context_len = max(int(config.max_position_embeddings), int(max_context_len))
    metadata = {
        "get_max_seq_len": tokens_per_call(program) if dynamic else int(max_context_len),
        "get_max_context_len": int(max_context_len),
        "get_vocab_size": logits_width(program),
        "get_n_layers": int(config.num_hidden_layers),
        "use_kv_cache": uses_kv_cache(program),
        "use_sdpa_with_kv_cache": uses_cache_sdpa(program),
        "enable_dynamic_shape": dynamic,
    }
    if isinstance(bos, int):
        metadata["get_bos_id"] = bos
    if eos_token_ids:  # without the method the runner stops on its tokenizer's eos; an empty list would never stop
        metadata["get_eos_ids"] = sorted(int(i) for i in eos_token_ids)
    return metadata
