"""The front ends users call: LLM (offline batches) and AsyncLLM (streaming, many users), with the
output processing that turns the core's token ids into text, stop strings and RequestOutputs."""
