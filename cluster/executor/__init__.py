"""Where steps run: one rank in this process (local.py), or rank 0 inside the coordinator actor
driving worker actors for ranks 1..N-1 on Ray (driver.py, actors.py), placed as one gang
(placement.py) on the cluster that ray_env.py connects to."""
