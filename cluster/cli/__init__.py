"""The `warpspec` command line (main.py), with its gRPC client (client.py) and demo (demo.py)."""
