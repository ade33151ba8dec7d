"""Parallel on-policy distillation (its own issue): teacher routing, teacher scoring, OPD loss, entry point."""
