"""Steps as compiled graphs: torch.compile'd CPU steps and captured CUDA graphs, their saved artifacts
and cache, the helper processes that build them, thread counts, and the torch internals they need."""
