"""Data: sharding samples across ranks, and the bundled example datasets."""
