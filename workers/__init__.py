"""One rank of a model replica: the model, its layers, the checkpoint loader, KV cache and runner."""
