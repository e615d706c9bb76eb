"""``tandem certs init DIR``: a deployment CA and one certificate per role, for compose and
Kubernetes (``tandem up`` makes its own throwaway set at every start).

Writes ``ca.pem``, ``ca-key.pem`` (keep it offline: it signs new members), ``trust-domain`` and
``<role>.pem`` / ``<role>-key.pem`` for the gateway, tokenizer, prefill, decode and operator roles
(``services/common/cert_authority.py``). Each service then runs with ``--tls-cert <role>.pem
--tls-key <role>-key.pem --tls-ca ca.pem``. Refuses to overwrite an existing CA unless
``--force``; ``--if-missing`` instead leaves an existing set alone and succeeds (compose's one-shot
``certs`` service runs it at every ``up``), issuing only what a ``--role-dir`` lacks.

Key custody: ``--role-dir ROLE=DIR`` writes that role's certificate, key and a copy of ``ca.pem``
into a directory of its own (compose: one volume per service, each service mounting only its
own), so no service can read another's key or the CA's, which stays in ``DIR`` alone.

Trust domain: certificates name their role as ``spiffe://<trust domain>/<role>``;
``--trust-domain`` sets the deployment's (default: a new ``tandem-<12 hex digits>``), kept in
``DIR/trust-domain`` so that roles issued later join the same one.
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
                             "verify servers as <role>.<trust domain>.tandem.internal, so none "
                             "is needed")
    parser.add_argument("--days", type=int, default=365, help="validity in days (default 365)")
    parser.add_argument("--force", action="store_true", help="overwrite an existing CA")
    parser.add_argument("--if-missing", action="store_true",
                        help="do nothing (and succeed) when DIR already holds a CA, except "
                             "issue what a --role-dir lacks or holds from an older Tandem")
    parser.add_argument("--role-dir", action="append", default=[], metavar="ROLE=DIR",
                        help="write ROLE's certificate, key and ca.pem into DIR instead of the "
                             "CA's directory (repeatable; one directory per role: key custody)")
    parser.add_argument("--trust-domain", default="", metavar="NAME",
                        help="the deployment's SPIFFE trust domain, in spiffe://NAME/<role> "
                             "(default: a new random one; empty: the same)")


def run(args: argparse.Namespace) -> int:
    """Entry point of ``tandem certs init``."""
    from services.common.cert_authority import CA_FILE, write_deployment_certs

    directory = Path(args.directory)
    role_dirs = _role_dirs(args.role_dir)
    if (directory / CA_FILE).exists() and args.if_missing and not args.force:
        issued = _issue_missing(directory, role_dirs, args.san, args.days)
        logger.info("%s already holds a CA; keeping it%s", directory,
                    f" (issued {', '.join(issued)})" if issued else "")  # fmt: skip
        return 0
    if (directory / CA_FILE).exists() and not args.force:
        raise InvalidArgumentError(
            f"{directory / CA_FILE} exists; pass --force to replace the deployment CA "
            "(every service then needs the new files)", param="directory")
    if args.days < 1:
        raise InvalidArgumentError("--days must be >= 1", param="days")
    write_deployment_certs(directory, keep_ca_key=True, extra_names=args.san, days=args.days,
                           trust_domain=args.trust_domain or None, role_dirs=role_dirs)  # fmt: skip
    logger.info("wrote a CA and certificates for every role to %s", directory)
    sys.stdout.write(f"{directory}\n")
    return 0


def _role_dirs(values: list[str]) -> dict[str, Path]:
    from services.common.peer_roles import ROLES

    out: dict[str, Path] = {}
    for value in values:
        role, sep, path = value.partition("=")
        if not sep or role not in ROLES or not path or role in out:
            raise InvalidArgumentError(
                f"--role-dir {value!r}: expected ROLE=DIR, once per role, ROLE one of "
                f"{', '.join(ROLES)}", param="role_dir")  # fmt: skip
        out[role] = Path(path)
    return out


def _issue_missing(directory: Path, role_dirs: dict[str, Path], san: list[str],
                   days: int) -> list[str]:  # fmt: skip
    """Issue, from the kept CA, each role whose own directory lacks its key (a volume made after
    the CA was) or holds a certificate without the server name clients now verify (issued by
    an older Tandem: ``cert_authority.carries_server_name``); the roles issued."""
    from services.common.cert_authority import (
        CA_FILE,
        CA_KEY_FILE,
        TRUST_DOMAIN_FILE,
        carries_server_name,
        load_ca,
        write_role_files,
    )
    from services.common.spiffe_id import DEFAULT_TRUST_DOMAIN

    domain_file = directory / TRUST_DOMAIN_FILE
    domain = domain_file.read_text().strip() if domain_file.exists() else DEFAULT_TRUST_DOMAIN

    def current(role: str, where: Path) -> bool:
        cert, key = where / f"{role}.pem", where / f"{role}-key.pem"
        return key.exists() and cert.exists() and carries_server_name(
            cert.read_bytes(), role, domain)

    missing = [r for r, d in role_dirs.items() if not current(r, d)]
    if not missing:
        return []
    ca = load_ca((directory / CA_FILE).read_bytes(), (directory / CA_KEY_FILE).read_bytes())
    for role in missing:
        write_role_files(ca, role, role_dirs[role], trust_domain=domain, extra_names=san,
                         days=days)  # fmt: skip
    return missing
