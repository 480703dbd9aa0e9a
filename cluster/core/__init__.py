"""The engine core: pure bookkeeping (sequences, KV blocks, the scheduler), the step that runs on an
executor (engine_core.py) with speculative decoding beside it (speculation.py), and the typed messages
between the core and the front ends."""
