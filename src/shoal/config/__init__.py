"""Validated configuration: the Trainer's settings and the `shoal train` YAML schema."""
