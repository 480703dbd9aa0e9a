"""Benchmarks, run with `warpspec bench NAME`. Figures are measured side by side in one run and
printed as tables (never asserted in tests)."""
