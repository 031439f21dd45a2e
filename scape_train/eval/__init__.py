"""Downstream evaluation with lm-eval."""
