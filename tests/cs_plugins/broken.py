"""create() raises after storage and lookup were built."""
from kvbridge.cache_server.module import DiscoverableModule
from tests.cs_plugins.fake_builtins.lookup import LookupModule


class BrokenModule(DiscoverableModule):
    module_name = "broken"
    dependencies = (LookupModule,)

    @classmethod
    def create(cls, build_ctx):
        raise RuntimeError("device not found")
