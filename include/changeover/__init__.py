"""Changeover: upgrade running PySpark jobs without losing their state."""

__version__ = "0.1.0"
