"""The files of a recipe's folder: atomic writes, the .pte's program table, tokenizer files."""
