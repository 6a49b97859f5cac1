"""Imports a module class but defines none: not a server module."""
from tests.cs_plugins.fake_builtins.storage import StorageModule  # noqa: F401
