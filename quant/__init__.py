"""Quantization schemes, all through torchao."""
