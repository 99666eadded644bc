"""shoal's version, in a module of its own so that any module can read it; the package's
metadata (pyproject.toml) reads it from here."""

__version__ = "0.2.0"
