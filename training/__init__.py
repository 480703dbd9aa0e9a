"""Training code: EAGLE-3 drafts for a target (and, later, the bundled target itself)."""
