"""Package attributes imported on first use (PEP 562): `import jaxstream` and the CLI's argument parsing stay
clear of jax, which takes ~0.4 s to import and must be imported after the CLI re-executes with TCMalloc."""
import importlib
import sys


def lazy_exports(package: str, table: dict[str, str]):
    """`__getattr__` and `__dir__` for `package`, whose public names (`table`: name -> module) are imported when
    first read, then kept in the package's namespace."""
    namespace = sys.modules[package].__dict__

    def __getattr__(name):  # noqa: N807 - the module protocol's name
        module = table.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(module), name)
        namespace[name] = value
        return value

    def __dir__():  # noqa: N807
        return sorted(set(namespace) | set(table))

    return __getattr__, __dir__
