"""The Measurement record, the SQLite store, JSON/CSV export."""

from mleng.results.record import SCHEMA, Measurement

__all__ = ["SCHEMA", "Measurement"]
