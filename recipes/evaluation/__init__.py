"""Distance from fp32: fidelity on two texts, the per-layer map, the layer-major reference."""
