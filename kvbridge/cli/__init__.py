"""The command line, one small module per command (or per small family of commands).

Place in the flow: `kvbridge` / `python -m kvbridge` (kvbridge.__main__) -> commands.build_parser() ->
the chosen Command's run(args) -> the package that does the work (gui, serve, cache_server, bench...).
Each module holds its command's arguments and body; commands.py is the table that lists them in the
order `--help` shows them. Nothing else in kvbridge imports this package: it sits on top of every layer.
"""
