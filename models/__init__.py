"""Getting a Llama checkpoint and wrapping it as an exportable module."""
