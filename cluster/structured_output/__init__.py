"""Structured outputs: a request's tokens held to a JSON schema, a regex, a choice or a grammar."""
