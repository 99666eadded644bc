"""Parallel strategies, one module each with an ``apply_...`` function."""
