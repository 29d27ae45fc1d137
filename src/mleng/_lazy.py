"""The public names of `import mleng` (mleng.ask, mleng.mamf, mleng.preflight, ...), resolved on first use.

`import mleng` must stay cheap (no torch, no sqlite, no argparse work), so every public function lives in
its own module and is imported when it is first touched. Two of them share their name with a module
(`mleng.doctor` the function and the checks package, `mleng.preflight` the function and its module): the
module is made callable, so `mleng.doctor()` runs the doctor, `mleng.doctor.runner` is still the module it
always was, and `import mleng.preflight` does not turn `mleng.preflight()` into "module is not callable".
"""

from __future__ import annotations

import importlib
import sys
import types

# public name -> "module:attribute"
PUBLIC: dict[str, str] = {
    "ask": "mleng.api:ask",
    "triage": "mleng.api:triage",
    "mamf": "mleng.api:mamf",
    "comm": "mleng.api:comm",
    "check": "mleng.api:check",
    "membw": "mleng.api:membw",
    "io": "mleng.api:io",
    "doctor": "mleng.api:doctor",
    "step": "mleng.api:step",
    "memory": "mleng.api:memory",
    "preflight": "mleng.preflight:preflight",
    "PreflightError": "mleng.preflight:PreflightError",
    "install_crash_hook": "mleng.crashhook:install_crash_hook",
    "crash_hook": "mleng.crashhook:crash_hook",
    "Measurement": "mleng.results.record:Measurement",
    "Store": "mleng.results.store:Store",
    "MlengError": "mleng.errors:MlengError",
    "UsageError": "mleng.errors:UsageError",
    "CheckFailed": "mleng.errors:CheckFailed",
    "NotAvailableError": "mleng.errors:NotAvailableError",
    "StoreError": "mleng.errors:StoreError",
}
# Modules that are also public functions of the same name: `mleng.doctor` (the checks package),
# `mleng.step` (the step package) and `mleng.preflight` (its module): calling the module calls the function.
CALLABLE_PACKAGES = ("doctor", "preflight", "step")
# Subpackages reachable as attributes without an explicit import (mleng.specs.lookup, mleng.results.Store).
SUBPACKAGES = ("specs", "results", "handbook")


def _resolve(target: str) -> object:
    module, _, attribute = target.partition(":")
    return getattr(importlib.import_module(module), attribute)


class CallablePackage(types.ModuleType):
    """A subpackage that is also a function: calling it calls the API function of the same name."""

    def __call__(self, *args: object, **kwargs: object) -> object:
        return _resolve(PUBLIC[self.__name__.rpartition(".")[2]])(*args, **kwargs)


def _make_callable(module: types.ModuleType) -> types.ModuleType:
    if not isinstance(module, CallablePackage):
        module.__class__ = CallablePackage
        name = module.__name__.rpartition(".")[2]
        try:
            import inspect

            module.__signature__ = inspect.signature(_resolve(PUBLIC[name]))  # help() and inspect see the function
        except Exception:  # noqa: BLE001 - a signature is a nicety; calling still works
            pass
    return module


def _package_property(name: str) -> property:
    slot = f"_mleng_package_{name}"

    def get(self: types.ModuleType) -> types.ModuleType:
        package = self.__dict__.get(slot)
        if package is None:
            package = importlib.import_module(f"{self.__name__}.{name}")  # cheap: no torch at import
            package = self.__dict__.get(slot) or package
        return _make_callable(package)

    def set_(self: types.ModuleType, value: object) -> None:
        # the import system binds a subpackage on its parent after loading it: keep it, made callable
        self.__dict__[slot] = _make_callable(value) if isinstance(value, types.ModuleType) else value

    return property(get, set_)


class _MlengModule(types.ModuleType):
    def __getattr__(self, name: str) -> object:
        if name in PUBLIC:
            value = _resolve(PUBLIC[name])
            self.__dict__[name] = value
            return value
        if name in SUBPACKAGES:
            return importlib.import_module(f"{self.__name__}.{name}")
        raise AttributeError(f"module {self.__name__!r} has no attribute {name!r}")

    def __dir__(self) -> list[str]:
        return sorted(set(super().__dir__()) | set(PUBLIC) | set(SUBPACKAGES))


for _name in CALLABLE_PACKAGES:
    setattr(_MlengModule, _name, _package_property(_name))


def install(module_name: str) -> None:
    """Give the `mleng` module its lazy public names."""
    module = sys.modules[module_name]
    for name in CALLABLE_PACKAGES:  # a subpackage imported before us (unusual) moves into its slot
        existing = module.__dict__.pop(name, None)
        if isinstance(existing, types.ModuleType):
            module.__dict__[f"_mleng_package_{name}"] = existing
    module.__class__ = _MlengModule
