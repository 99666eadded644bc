"""Models from other libraries, each met in one adapter module (``hf``: transformers)."""
