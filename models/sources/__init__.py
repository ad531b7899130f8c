"""Where a checkpoint comes from (the built-in model, the Hub, a local folder or GGUF file, a random stand-in) and
whether it holds together, before the module is built from it."""
