"""Server modules that exist only for tests/test_cache_server_modules.py, loaded by module_path
(`tests.cs_plugins.echo`, ...). fake_builtins stands in for kvbridge.cache_server.modules, which is
written separately; EVENTS records quiesce/close calls so a test can read their order.
"""

EVENTS: list[str] = []
