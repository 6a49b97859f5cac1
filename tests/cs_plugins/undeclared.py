"""require()s the management module without declaring it."""
from kvbridge.cache_server.module import DiscoverableModule
from tests.cs_plugins.fake_builtins.management import ManagementModule


class Sneaky(DiscoverableModule):
    module_name = "sneaky"

    @classmethod
    def create(cls, build_ctx):
        build_ctx.require(ManagementModule)
        return cls(build_ctx.server_context)
