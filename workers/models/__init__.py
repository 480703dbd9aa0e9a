"""The model families warpspec serves: registry.py names them by architecture, decoder.py holds what
they share, and each family is one module (llama4.py, llama.py)."""
