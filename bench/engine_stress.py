"""Issue 43's stress test, longer and repeated: ``--runs`` runs of ``--streams`` concurrent
constrained / unconstrained streams through the real gateway onto two real decode workers, with
random disconnects and one decode worker's engine step failing mid-run (its streams must migrate),
each on a fresh stack (the failed worker stays unhealthy). Prints one row per run and the tally;
exits 1 if any run saw a stream fail that was not disconnected on purpose.

    .venv/bin/python bench/engine_stress.py --runs 20 --streams 32

Load the machine with a second busy process (``python -c 'while True: pass' &``) to widen the
race windows. The CI-size version is ``tests/test_engine_stress.py``.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.engine_stress import StressResult, run_stress, stress_stack  # noqa: E402

logger = logging.getLogger("engine_stress")


async def main(args: argparse.Namespace) -> int:
    folder = Path(tempfile.mkdtemp(prefix="engine-stress-")) / "tiny"
    results: list[StressResult] = []
    logger.info("%4s %8s %6s %6s %6s %12s %8s", "run", "streams", "done", "cut", "failed",
                "migration", "seconds")  # fmt: skip
    for run in range(args.runs):
        async with stress_stack(folder) as stack:
            result = await run_stress(stack, streams=args.streams, seed=args.seed + run,
                                      fail_a_step=not args.no_failure, timeout_s=args.timeout)  # fmt: skip
        results.append(result)
        done = sum(o in ("stop", "length") for o in result.outcomes)
        logger.info("%4d %8d %6d %6d %6d %12s %8.1f", run, len(result.outcomes), done,
                    result.outcomes.count("disconnected"), len(result.failures),
                    "yes" if result.migrated else "no", result.seconds)  # fmt: skip
        for failure in result.failures:
            logger.info("      %s", failure[:300])
    passed = sum(r.ok for r in results)
    logger.info("passed %d of %d runs", passed, len(results))
    return 0 if passed == len(results) else 1


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=20)
    parser.add_argument("--streams", type=int, default=32)
    parser.add_argument("--seed", type=int, default=1000)
    parser.add_argument("--timeout", type=float, default=120.0, help="per run, seconds")
    parser.add_argument("--no-failure", action="store_true", help="no injected step failure")
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    for noisy in ("services", "aiohttp", "grpc"):
        logging.getLogger(noisy).setLevel(logging.ERROR)
    sys.exit(asyncio.run(main(parser.parse_args())))
