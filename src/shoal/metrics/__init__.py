"""Step metrics, resource use and stragglers, measured on every rank."""
