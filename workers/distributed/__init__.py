"""Collectives among one replica's ranks: the communicator interface and its backends (gloo, shared
memory, NCCL), and the traced ops a compiled step meets its peers through."""
