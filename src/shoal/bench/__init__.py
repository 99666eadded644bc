"""Benchmarks shipped with the product: all-reduce bandwidth and scaling."""
