"""Named plugins of recorded task streams (verifiers, tool environments): built-ins plus user functions that an
installed package publishes under an entry-point group, loaded only when the run's config enables them by name.
A stream row only names a plugin: no code or import path is ever taken from a message."""

from __future__ import annotations

from collections.abc import Callable
from importlib.metadata import entry_points


class PluginError(ValueError):
    """What is wrong, and with which field of a row (e.g. `verifier`, `params.pattern`, `tools.env`)."""

    def __init__(self, field: str, msg: str) -> None:
        super().__init__(msg)
        self.field = field


class Registry:
    def __init__(self, kind: str, group: str, field: str, builtin: dict[str, Callable]) -> None:
        self.kind, self.group, self.field, self.builtin = kind, group, field, builtin
        self.enabled: dict[str, Callable] = {}
        self._values: dict[str, str] = {}  # name -> its entry point's `module:attr`

    def entry_points(self) -> list:
        return list(entry_points(group=self.group))

    def enable(self, names: list[str]) -> None:
        """Load the named user plugins from the installed packages' entry points of this registry's group."""
        found = {ep.name: ep for ep in self.entry_points()}
        for name in names:
            if name in self.builtin:
                continue
            if name not in found:
                raise PluginError(self.field, f"{self.kind} '{name}': no entry point '{name}' in group {self.group} "
                                              f"(installed: {', '.join(sorted(found)) or 'none'})")
            fn = found[name].load()
            if not callable(fn):
                raise PluginError(self.field, f"{self.kind} '{name}': entry point {found[name].value} is not callable")
            self.enabled[name] = fn
            self._values[name] = found[name].value

    def sources(self) -> dict[str, str]:
        """The enabled user plugins' `module:attr` (their entry points' values), for a process that loads them anew."""
        return {name: self._values.get(name) or f"{fn.__module__}:{fn.__qualname__}"
                for name, fn in self.enabled.items()}

    def known(self) -> list[str]:
        return [*self.builtin, *self.enabled]

    def get(self, name: str) -> Callable | None:
        return self.builtin.get(name) or self.enabled.get(name)

    def check_name(self, name: object) -> None:
        if not isinstance(name, str) or self.get(name) is None:
            raise PluginError(self.field, f"{self.kind} {name!r}: unknown (known: {', '.join(self.known())}; user "
                                          f"{self.kind}s are enabled by name in the run's config)")

