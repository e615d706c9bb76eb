"""The ``tandem`` command: ``generate`` (offline batch demo), ``serve <service>`` (one service),
``up`` (the whole system as local processes), ``tune`` (time the CPU kernels once per
machine), ``bench serve`` (load-test any OpenAI-compatible
server), ``certs init`` (a CA and certificates for internal mutual TLS).

Each subcommand lives in the module that owns it and exposes ``add_arguments(parser)`` and
``run(args) -> int``; this file only wires them up, importing lazily so that ``tandem serve
gateway`` never imports torch. Errors from Tandem itself print one line and exit 2.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import sys
from collections.abc import Sequence

from services.common.errors import TandemError

logger = logging.getLogger(__name__)

# subcommand -> module with add_arguments(parser) and run(args)
COMMANDS = {
    "generate": ("services.engine.runtime.generate_cli", "run prompts through the engine offline"),
    "up": ("services.launcher", "start tokenizer, prefill, decode and gateway as local processes"),
    "tune": ("services.tune_cli",
             "time this machine's CPU kernels once, for every worker that starts later"),
}
SERVICES = {
    "tokenizer": "services.tokenizer.main",
    "prefill": "services.prefill.main",
    "decode": "services.decode.main",
    "gateway": "services.gateway.main",
}
BENCHES = {
    "serve": ("services.loadgen.cli", "load-test any OpenAI-compatible server (Tandem or other)"),
}
CERTS = {
    "init": ("services.certs_cli", "write a deployment CA and a certificate per service role"),
}


def build_parser(argv: Sequence[str]) -> argparse.ArgumentParser:
    """The full parser; only the module of the chosen subcommand is imported."""
    words: list[str] = []
    skip = False
    for word in argv:  # positional words, skipping the value of ``--log-level VALUE``
        if skip:
            skip = False
        elif word == "--log-level":
            skip = True
        elif not word.startswith("-"):
            words.append(word)
    parser = argparse.ArgumentParser(prog="tandem", description=__doc__.splitlines()[0])
    parser.add_argument("--log-level", default="INFO", help="logging level (default INFO)")
    sub = parser.add_subparsers(dest="command", required=True)
    for name, (module, help_text) in COMMANDS.items():
        p = sub.add_parser(name, help=help_text, description=help_text)
        p.set_defaults(module=module)
        if words[:1] == [name]:
            importlib.import_module(module).add_arguments(p)
    serve = sub.add_parser("serve", help="run one service", description="run one Tandem service")
    serve_sub = serve.add_subparsers(dest="service", required=True)
    for name, module in SERVICES.items():
        p = serve_sub.add_parser(name, help=f"the {name} service")
        p.set_defaults(module=module)
        if words[:2] == ["serve", name]:
            importlib.import_module(module).add_arguments(p)
    bench = sub.add_parser("bench", help="benchmarks", description="Tandem's benchmarks")
    bench_sub = bench.add_subparsers(dest="bench", required=True)
    for name, (module, help_text) in BENCHES.items():
        p = bench_sub.add_parser(name, help=help_text, description=help_text)
        p.set_defaults(module=module)
        if words[:2] == ["bench", name]:
            importlib.import_module(module).add_arguments(p)
    certs = sub.add_parser("certs", help="internal mutual-TLS certificates",
                           description="certificates for internal mutual TLS (docs/security.md)")
    certs_sub = certs.add_subparsers(dest="certs", required=True)
    for name, (module, help_text) in CERTS.items():
        p = certs_sub.add_parser(name, help=help_text, description=help_text)
        p.set_defaults(module=module)
        if words[:2] == ["certs", name]:
            importlib.import_module(module).add_arguments(p)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser(argv).parse_args(argv)
    from services.common.logging_setup import configure_logging

    configure_logging(args.log_level)
    try:
        return int(importlib.import_module(args.module).run(args) or 0)
    except TandemError as exc:
        print(f"tandem: error: {exc.message}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
