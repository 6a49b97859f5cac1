"""`kvbridge bench-restore`: a 2k-token restore against a plain memory copy, embedded and through a
private cache server (shared memory, and inline bytes over loopback TCP), in one run on one model."""
from __future__ import annotations

import tempfile

from kvbridge.bench.registry import bench_command
from kvbridge.cli.command import Command
from kvbridge.cli.common import add_engine_options, make_engine, settings_from
from kvbridge.errors import KVBridgeError
from kvbridge.settings import Settings


def add_arguments(p) -> None:
    add_engine_options(p)
    p.add_argument("--tokens", type=int, default=2048, help="prefix length to restore (default 2048)")
    p.add_argument("--repeats", type=int, default=7, help="runs (median is shown)")
    p.add_argument("--no-cache-server", action="store_true",
                   help="the embedded store only (no private cache server, no server rows)")


def run(args) -> int:
    from kvbridge.bench.common.report import bench_restore

    settings = settings_from(args)
    if not args.no_cache_server:
        return _bench_restore_with_server(settings, args)
    with tempfile.TemporaryDirectory(prefix="kvb-bench-l2-") as l2:
        with make_engine(settings, l2) as engine:
            _check_restore_engine(engine)
            r = bench_restore(engine, prompt_tokens=args.tokens, repeats=args.repeats)
    print(f"restore of {r['restored_tokens']} tokens ({r['state_bytes'] / 1e6:.1f} MB): "
          f"{r['restore_ms']:.1f} ms (lookup+fetch+assemble+set), plain memory copy {r['memcpy_ms']:.1f} ms, "
          f"ratio {r['ratio']:.2f}x (target <= 3x)")
    return 0


def _check_restore_engine(engine) -> None:
    if engine.backend.kv_mode != "full" or engine.geometry is None:
        raise KVBridgeError("bench-restore needs a full-KV engine with a chunked layout (llamacpp, llama-server).")


def _bench_restore_with_server(settings: Settings, args) -> int:
    """The embedded restore, the same restore through a private cache server's shared memory, and its
    objects as inline bytes over loopback TCP, all in one run on one loaded model."""
    from contextlib import closing

    from kvbridge.bench.cache_server_bench import bench_inline_vs_socket, bench_restore_through_server
    from kvbridge.bench.common.private_server import bench_client, private_cache_server
    from kvbridge.cache_server.remote_store import RemoteStore

    with tempfile.TemporaryDirectory(prefix="kvb-bench-l2-") as l2, private_cache_server(settings) as server:
        with make_engine(settings, l2) as engine:
            _check_restore_engine(engine)
            with closing(RemoteStore.from_settings(server.engine_settings)) as remote:
                r = bench_restore_through_server(engine, remote, prompt_tokens=args.tokens, repeats=args.repeats)
            with bench_client(server, use_shm=False) as inline_client:
                i = bench_inline_vs_socket(inline_client, r["keys"], engine.namespace, repeats=args.repeats,
                                           server_pid=server.pid)
    print(f"restore of {r['restored_tokens']} tokens ({r['state_bytes'] / 1e6:.1f} MB, {r['objects']} objects), "
          f"medians of {args.repeats}, interleaved:")
    print(f"  embedded store        {r['embedded_ms']:7.1f} ms (lookup+fetch+assemble+set), plain memory copy "
          f"{r['memcpy_ms']:.1f} ms, ratio {r['embedded_vs_copy']:.2f}x (target <= 3x)")
    print(f"  cache server, shm     {r['server_shm_ms']:7.1f} ms ({r['server_restored_tokens']} tokens from "
          f"{r['server_tier']}), {r['server_vs_embedded']:.2f}x the embedded restore (target <= 1.5x)")
    print(f"  inline over TCP (CURVE), the {i['objects']} objects ({i['bytes'] / 1e6:.1f} MB) against a plain "
          f"loopback socket sending the same sizes ({i['socket_ms']:.1f} ms):")
    frames = f"{i['frame_bytes'] / 2**20:g} MiB frames"
    cpu = i["cpu_ms"]
    print(f"    one by one, {frames:<16} {i['inline_ms']:7.1f} ms, ratio {i['inline_vs_socket']:.2f}x (target <= 3x)")
    print(f"    one by one, whole objects    {i['whole_ms']:7.1f} ms, ratio {i['whole_vs_socket']:.2f}x (the wire before "
          "issue 47)")
    print(f"    one retrieve_many, {frames:<9} {i['many_ms']:7.1f} ms, ratio {i['many_vs_socket']:.2f}x (a restore's call)")
    if i["cipher_ms"] is None:
        print("    the cipher alone: not measured (no libsodium found to call)")
    else:
        print(f"    the cipher alone             {i['cipher_ms']:7.1f} ms, ratio {i['cipher_vs_socket']:.2f}x (libsodium "
              "XSalsa20-Poly1305 sealing and opening the same bytes on one core, no socket)")
    print("    CPU time (bench process + server), medians: " + ", ".join(
        f"{name} {ms:.0f} ms" for name, ms in cpu.items()))
    return 0


COMMAND = Command("bench-restore", bench_command("bench-restore").measures, run, add_arguments)
