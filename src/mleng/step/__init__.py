"""`mleng step`: a real training step of a built-in Llama-style model, measured (tokens/s, MFU, MAMFU, memory, breakdown)."""
