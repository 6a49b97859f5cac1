"""Plugin modules named by string: how a lower layer finds the code that plugs into it from above.

Place in the architecture: the engine table (settings/engines.py), the KV codecs (settings/codecs.py),
the remote stores (store/opening.py) and the engine modes (engine/modes.py) are each filled by modules
of a higher layer that register themselves when imported. The lower layer never imports them in its
code; it keeps their names in a table and imports them by name on the first lookup (as vLLM's model
registry and Python's entry points do), so a package layer only ever imports downwards.

A module that fails to import is remembered with its error: the other plugins keep working, and the
registry that asked names the broken module when someone asks for what it would have registered.
"""
from __future__ import annotations

import importlib


class PluginModules:
    """A table's built-in plugin modules, imported once, on the first `load()`."""

    def __init__(self, modules: tuple[str, ...], *, tolerate: type[BaseException] = Exception) -> None:
        self.modules = tuple(modules)
        self.broken: dict[str, str] = {}   # module -> "ErrorType: message"
        self._tolerate = tolerate          # what a broken plugin may raise; anything else propagates
        self._loaded = False

    def load(self) -> None:
        if self._loaded:
            return
        self._loaded = True   # before importing: a plugin that asks its registry while it registers must not loop
        for module in self.modules:
            try:
                importlib.import_module(module)
            except self._tolerate as error:  # noqa: BLE001 - one broken plugin must not hide the others; its registry reports it
                self.broken[module] = f"{type(error).__name__}: {error}"

    def broken_summary(self, separator: str = "; ") -> str:
        """'module (ErrorType: message)' for each module that did not import, joined."""
        return separator.join(f"{module} ({error})" for module, error in self.broken.items())
