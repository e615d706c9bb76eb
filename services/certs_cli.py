"""``tandem certs init DIR``: a deployment CA and one certificate per role, for compose and
Kubernetes (``tandem up`` makes its own throwaway set at every start).

Writes ``ca.pem``, ``ca-key.pem`` (keep it offline: it signs new members) and ``<role>.pem`` /
``<role>-key.pem`` for the gateway, tokenizer, prefill, decode and operator roles
(``services/common/cert_authority.py``). Each service then runs with ``--tls-cert <role>.pem
--tls-key <role>-key.pem --tls-ca ca.pem``. Refuses to overwrite an existing CA unless
``--force``; ``--if-missing`` instead leaves an existing set alone and succeeds (compose's one-shot
``certs`` service runs it at every ``up``).
"""

from __future__ import annotations

import argparse
import sys
import logging
from pathlib import Path

from services.common.errors import InvalidArgumentError

logger = logging.getLogger(__name__)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags of ``tandem certs init``."""
    parser.add_argument("directory", metavar="DIR", help="where to write the files (made 0700)")
    parser.add_argument("--san", action="append", default=[], metavar="NAME",
                        help="an extra DNS name or IP in every certificate (repeatable); clients "
                             "verify servers as <role>.tandem.internal, so none is needed")
    parser.add_argument("--days", type=int, default=365, help="validity in days (default 365)")
    parser.add_argument("--force", action="store_true", help="overwrite an existing CA")
    parser.add_argument("--if-missing", action="store_true",
                        help="do nothing (and succeed) when DIR already holds a CA")


def run(args: argparse.Namespace) -> int:
    """Entry point of ``tandem certs init``."""
    from services.common.cert_authority import CA_FILE, write_deployment_certs

    directory = Path(args.directory)
    if (directory / CA_FILE).exists() and args.if_missing and not args.force:
        logger.info("%s already holds a CA; keeping it", directory)
        return 0
    if (directory / CA_FILE).exists() and not args.force:
        raise InvalidArgumentError(
            f"{directory / CA_FILE} exists; pass --force to replace the deployment CA "
            "(every service then needs the new files)", param="directory")
    if args.days < 1:
        raise InvalidArgumentError("--days must be >= 1", param="days")
    write_deployment_certs(directory, keep_ca_key=True, extra_names=args.san, days=args.days)
    logger.info("wrote a CA and certificates for every role to %s", directory)
    sys.stdout.write(f"{directory}\n")
    return 0
