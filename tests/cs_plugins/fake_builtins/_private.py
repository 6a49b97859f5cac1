from kvbridge.cache_server.module import DiscoverableModule


class PrivateModule(DiscoverableModule):
    """In a submodule whose name starts with '_': discovery must skip it."""

    module_name = "private"

    @classmethod
    def create(cls, build_ctx):
        return cls(build_ctx.server_context)
