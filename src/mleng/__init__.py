"""mleng: measure GPU training machines, compare with theory, look up the pitfall, decide."""

__version__ = "0.1.0"

# The Python API (mleng.ask, mleng.mamf, mleng.preflight, ...; docs/api.md) is resolved on first use,
# so `import mleng` imports neither torch nor anything else heavy.
from mleng._lazy import install as _install

_install(__name__)
del _install
