"""Backend recipes and the single lowering pipeline."""
