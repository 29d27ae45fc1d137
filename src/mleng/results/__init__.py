"""The Measurement record, the SQLite store, JSON/CSV export."""

from mleng.results.record import SCHEMA, Measurement

__all__ = ["SCHEMA", "Measurement", "Store"]


def __getattr__(name: str):
    # The store (sqlite3) is loaded when first asked for: `import mleng.results` stays as cheap as the record.
    if name == "Store":
        from mleng.results.store import Store

        return Store
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
