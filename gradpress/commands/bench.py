"""``gradpress bench``: benchmarks, one subcommand per module of
:mod:`gradpress.bench` that exposes ``register_bench(subparsers)``
(``gradpress bench compressors``, later ``gradpress bench e2e``).

A benchmark module that fails to import still gets a subcommand (named after
the module) that reports the import error instead of breaking every other
``gradpress`` command.
"""

from __future__ import annotations

import argparse

from gradpress.bench import bench_modules


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("bench", help="benchmarks: compressor micro-benchmark, end-to-end runs",
                       description="Benchmarks. Run 'gradpress bench SUBCOMMAND -h' for the options of each.")
    bench_sub = p.add_subparsers(dest="bench_command", metavar="SUBCOMMAND")
    for name, module, error in bench_modules():
        if module is None:
            q = bench_sub.add_parser(name, help=f"(unavailable: {error})")
            q.set_defaults(func=_unavailable(name, error))
        else:
            module.register_bench(bench_sub)
    p.set_defaults(func=_usage(p))


def _usage(parser: argparse.ArgumentParser):
    def run(args: argparse.Namespace) -> int:
        parser.print_help()
        return 2

    return run


def _unavailable(name: str, error: str):
    def run(args: argparse.Namespace) -> int:
        raise ValueError(f"benchmark {name!r} is unavailable: {error}")

    return run
