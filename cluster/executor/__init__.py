"""Where steps run: one rank in this process (local.py), or a coordinator actor with rank 0 and
worker actors for ranks 1..N-1 on Ray (coordinator.py, actors.py, ray_executor.py, ray_env.py)."""
