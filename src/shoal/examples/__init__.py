"""Ready-made builders for the example configs (importable as shoal.examples.*)."""
