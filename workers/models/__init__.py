"""The model families warpspec serves: registry.py names them by architecture, decoder.py holds what
they share, and each family is one module (llama4.py, llama.py). Beside them: the EAGLE-3 draft model
(eagle3_draft.py) and RoPE's frequencies (rotary.py)."""
