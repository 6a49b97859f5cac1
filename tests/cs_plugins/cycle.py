"""alpha -> beta -> alpha, and gamma downstream of the cycle (not part of it)."""
from kvbridge.cache_server.module import DiscoverableModule


class _Create:
    """A mixin, not a DiscoverableModule: discovery does not take it."""

    @classmethod
    def create(cls, build_ctx):
        return cls(build_ctx.server_context)


class Alpha(_Create, DiscoverableModule):
    module_name = "alpha"


class Beta(_Create, DiscoverableModule):
    module_name = "beta"
    dependencies = (Alpha,)


class Gamma(_Create, DiscoverableModule):
    module_name = "gamma"
    dependencies = (Alpha,)


Alpha.dependencies = (Beta,)
