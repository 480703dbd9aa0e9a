"""Engine configuration: one dataclass per concern under EngineConfig (engine.py), and the options
users set by name, with the front ends and flags that take them (options.py)."""
