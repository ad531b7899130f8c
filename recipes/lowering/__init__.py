"""Export and lowering to a .pte: the one to_edge_transform_and_lower call, delegation, LLM metadata."""
