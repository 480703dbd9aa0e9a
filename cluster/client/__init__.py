"""How a front end reaches an engine core that runs in a coordinator actor (remote_engine.py)."""
