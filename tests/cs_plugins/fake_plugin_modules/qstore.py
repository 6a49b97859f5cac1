from kvbridge.cache_server.module import DiscoverableModule


class QStoreModule(DiscoverableModule):
    module_name = "qstore"

    @classmethod
    def create(cls, build_ctx):
        return cls(build_ctx.server_context)
