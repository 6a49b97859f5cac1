"""report_status() and close() raise: the others must still report and close."""
from kvbridge.cache_server.module import DiscoverableModule
from tests.cs_plugins import EVENTS


class FragileModule(DiscoverableModule):
    module_name = "fragile"

    @classmethod
    def create(cls, build_ctx):
        return cls(build_ctx.server_context)

    def report_status(self) -> dict:
        raise RuntimeError("status exploded")

    def close(self) -> None:
        EVENTS.append("fragile.close")
        raise RuntimeError("close exploded")
