"""Choosing tokens from logits: the sampler, speculative verification (rejection sampling), and the
keyed random streams that make seeded requests independent of the crowd."""
