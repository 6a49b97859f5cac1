"""Server modules that exist only in the tests, loaded into a real cache server by module_path
(tests.cs_live_plugins.<name>): they depend on, wrap and replace the real built-in modules."""
