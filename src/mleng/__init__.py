"""mleng: measure GPU training machines, compare with theory, look up the pitfall, decide."""

__version__ = "0.1.0"
