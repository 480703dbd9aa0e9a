"""Speculative decoding: the proposer interface, the EAGLE-3 proposer and its loading, and acceptance
statistics."""
