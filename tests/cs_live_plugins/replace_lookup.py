"""Replaces the built-in LookupModule: a subclass keeping module_name "lookup" that counts what it answers."""
from __future__ import annotations

from kvbridge.cache_server.modules.lookup import LookupModule


class CountingLookupModule(LookupModule):
    def __init__(self, context) -> None:
        super().__init__(context)
        self.answered_by_replacement = 0

    def lookup(self, call):
        self.answered_by_replacement += 1
        return super().lookup(call)

    def report_status(self) -> dict:
        return {**super().report_status(), "replacement": True, "answered": self.answered_by_replacement}
