#!/usr/bin/env python3
"""End-to-end test of ``docker compose up`` on a machine with a Docker engine (Compose v2 >= 2.24).

What a user does, checked step by step (tests/test_compose_stack.py runs it under pytest):

1. build the image (Docker Hub or download.pytorch.org out of reach: a Debian-built base image,
   scripts/debian_base_image.sh, and a local torch wheel with PyPI; see ``--help``);
2. ``docker compose -f compose.yaml -f compose.cpu.yaml up -d``: every healthcheck healthy, and
   the gateway's ``/ready`` lists every worker and tokenizer container by its address (two
   tokenizer replicas);
3. greedy streamed chat completions through the published port with the ``openai`` SDK equal
   ``tandem generate`` in the same image;
4. ``up -d --scale prefill=2 --scale decode=3``: ``/ready`` lists every replica (DNS), requests
   land on more than one decode replica (each replica's own metrics), and each conversation's
   next turn is served from the prefix cache of the replica that holds its first;
5. one tokenizer replica killed: every request still answers (the gateway retries a failed
   call on the other replica), ``/ready`` stays ready, and ``compose up`` starts it again;
6. a decode replica killed mid-stream, twice: by ``docker kill`` (Docker then leaves it stopped,
   as after any user's stop, and ``compose up`` starts it again) and by a crash (SIGKILL to its
   init from the host, which the ``restart:`` policy answers): every stream completes with its
   undisturbed greedy text (see :func:`undisturbed` for prompts at a near-tie), the gateway
   counts the migration, routes to the restarted replica again, and every live replica's
   ``tandem:kv_blocks_in_use`` returns to 0;
7. ``docker compose down -v`` leaves no container, network or volume of the project.

Exit status 0 when every check passed; the log says what was measured (build time, image size,
time to healthy and ready) and, on failure, what broke, with the services' last log lines.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import logging
import sys
import time
from collections.abc import Callable
from pathlib import Path

from compose_client import Client, Going, get_json, worker_metric
from compose_setup import BuildPlan, build_image, compose_env, free_port, plan_build
from compose_stack import Replica, Stack, StackError, run

logger = logging.getLogger("compose_test")
REPO = Path(__file__).resolve().parents[1]
FILES = ["compose.yaml", "compose.cpu.yaml"]
IMAGE = "tandem:cpu"  # compose.cpu.yaml's image
METRICS_PORT = {"prefill": 9111, "decode": 9121, "gateway": 9102}  # services/common/ports.py
SCALE = {"prefill": 2, "decode": 3}
TOKENIZERS = {"tokenizer": 2}  # compose.yaml's deploy.replicas
TOKENS = 64
# The workers' and `tandem generate`'s --dtype. Not `auto`: its q4_a8 rounds prompt rows to int8
# only where the int8 GEMM measured faster than float activations when the process started
# (autotune), so on a busy machine two processes of one image can take different prompt paths
# and part at a near-tie of greedy text. q4 (4-bit weights, float activations) is one path.
DTYPE = "q4"
# Not ("cat", "swim"): its greedy text forks at its 6th token on a near-tie that replicas decide
# differently (see undisturbed()), so a stream moved there at tokens 4-5 continued as the new
# replica would have ("a small village" for "a bustling city") in one of four runs.
ANIMALS = [("dog", "sing"), ("fox", "paint"), ("owl", "cook"), ("bear", "dance"), ("frog", "knit")]
PROMPTS = [f"Write a story number {i} about a {animal} who learns to {skill}."
           for i, (animal, skill) in enumerate(ANIMALS, start=1)]  # fmt: skip
TOPICS = ["the history of the printing press", "how bees build their hives",
          "the water cycle on Earth"]  # fmt: skip


class CheckFailed(AssertionError):
    """A check of the running stack did not hold."""


def check(condition: bool, what: str) -> None:
    if not condition:
        raise CheckFailed(what)
    logger.info("ok: %s", what.split("\n")[0])


def wait_for(what: str, probe: Callable[[], bool], timeout: float, every: float = 1.0) -> float:
    """Poll ``probe`` until true; the seconds it took, or :class:`CheckFailed`."""
    started = time.monotonic()
    while not probe():
        if time.monotonic() - started > timeout:
            raise CheckFailed(f"{what}: not within {timeout:.0f} s")
        time.sleep(every)
    took = time.monotonic() - started
    logger.info("ok: %s (%.0f s)", what, took)
    return took


def running(stack: Stack, service: str) -> list[Replica]:
    return [r for r in stack.replicas(service) if r.state == "running"]


def gateway_metric(stack: Stack, name: str) -> float:
    """One unlabelled metric of the gateway, from its own metrics port (not published, not the
    API's: reached, as the workers' are, by the container's address on the compose network)."""
    (gateway,) = running(stack, "gateway")
    return worker_metric(gateway.ip, METRICS_PORT["gateway"], name)


def ready_lists_every_replica(stack: Stack, client: Client) -> bool:
    """``/ready`` is ready, and its tokenizer replicas and prefill and decode workers are exactly
    the running containers' addresses, all healthy."""
    ready = client.ready()
    if ready.get("status") != "ready":
        return False
    for role in ("tokenizer", "prefill", "decode"):
        listed = {w["address"].rsplit(":", 1)[0] for w in ready[role] if w["healthy"]}
        if listed != {r.ip for r in running(stack, role)} or len(listed) != len(ready[role]):
            return False
    return True


def generated(stack: Stack) -> dict[str, float]:
    """Tokens each running decode replica has sampled (its own metrics), by container."""
    port = METRICS_PORT["decode"]
    return {r.container: worker_metric(r.ip, port, "tandem:generation_tokens_total")
            for r in running(stack, "decode")}  # fmt: skip


def offline_text(prompt: str) -> str:
    """``tandem generate``'s greedy text for ``prompt`` in the image, without the stack."""
    out = run(["docker", "run", "--rm", "--network", "none", "-e", "TANDEM_AUTOTUNE=fixed", IMAGE,
               "tandem", "generate", "--chat",
               prompt, "--max-tokens", str(TOKENS), "--temperature", "0", "--ignore-eos", "--json",
               "--dtype", DTYPE], timeout=900)  # fmt: skip
    return str(json.loads(out.strip().splitlines()[-1])["text"])


def compare_with_generate(client: Client, prompt: str, offline: str) -> None:
    served = client.stream(prompt, TOKENS)
    check(served.error is None and served.completion_tokens == TOKENS, f"streamed: {served}")
    check(served.text == offline,
          f"greedy stream through the gateway == tandem generate\n{served.text!r}\n{offline!r}")


def spread_and_prefix_routing(stack: Stack, client: Client) -> None:
    before = generated(stack)
    with concurrent.futures.ThreadPoolExecutor(len(PROMPTS)) as pool:
        outcomes = list(pool.map(lambda p: client.stream(p, 16), PROMPTS))
    check(all(o.error is None for o in outcomes), f"concurrent streams: {outcomes}")
    after = generated(stack)
    used = sorted(c for c in after if after[c] > before.get(c, 0.0))
    check(len(used) > 1, f"requests landed on {len(used)} decode replicas: {used}")
    for topic in TOPICS:  # one turn at a time, so each first turn goes where routing puts it
        opening = [{"role": "user", "content": (
            f"I am writing a long essay about {topic}. Please explain {topic} in detail, with its "
            "causes, its consequences, three surprising facts and a short summary, using plain "
            "words a twelve year old can follow.")}]  # fmt: skip
        text, prompt_tokens, _ = client.chat(opening, 24)
        follow = [*opening, {"role": "assistant", "content": text},
                  {"role": "user", "content": "Say that in one line."}]  # fmt: skip
        _, _, cached = client.chat(follow, 8)
        check(cached >= prompt_tokens // 16 * 16 > 0,
              f"next turn on {topic!r} served {cached} of its first {prompt_tokens} prompt "
              "tokens from the replica holding them")  # fmt: skip


def survive_a_tokenizer_kill(stack: Stack, client: Client) -> None:
    """Kill one of the two tokenizer replicas: every request still answers (a call that meets
    the dead replica is retried on the other) and ``/ready`` stays ready; then start it again."""
    victim = running(stack, "tokenizer")[0]
    stack.kill(victim.container)
    started = time.monotonic()
    outcomes = [client.stream(p, 8) for p in PROMPTS * 2]
    took = time.monotonic() - started
    check(all(o.error is None and o.completion_tokens == 8 for o in outcomes),
          f"{len(outcomes)} streams with {victim.container} killed ({took:.1f} s): {outcomes}")
    ready = client.ready()
    check(ready.get("status") == "ready", f"/ready with one tokenizer replica down: {ready}")
    stack.up(SCALE)  # compose starts it again
    stack.wait_healthy({**TOKENIZERS, **SCALE, "gateway": 1}, timeout=600)
    wait_for("/ready lists both tokenizer replicas again",
             lambda: ready_lists_every_replica(stack, client), 120)  # fmt: skip


def kill_mid_stream(stack: Stack, client: Client, reference: dict[str, set[str]],
                    kill: Callable[[str], None]) -> str:
    """Stream every prompt at once, kill a decode replica serving some once all are emitting;
    every stream must still end with an undisturbed text of its prompt (one, except for the
    prompts :func:`undisturbed` found replica-dependent). The killed container's name."""
    migrations = gateway_metric(stack, "tandem:migrations_total")
    going = Going(len(PROMPTS))
    with concurrent.futures.ThreadPoolExecutor(len(PROMPTS)) as pool:
        futures = {pool.submit(client.stream, p, TOKENS, going): p for p in PROMPTS}
        if not going.event.wait(300):
            raise CheckFailed("the streams did not all get going")
        decode = client.ready()["decode"]
        serving = {w["address"].rsplit(":", 1)[0] for w in decode if w["in_flight"]}
        victim = next(r for r in running(stack, "decode") if r.ip in serving)
        kill(victim.container)
        outcomes = {futures[f]: f.result(timeout=600) for f in futures}
    logger.info("killed %s with %d streams emitting", victim.container, len(PROMPTS))
    for prompt, out in outcomes.items():
        complete = out.finish_reason == "length" and out.completion_tokens == TOKENS
        check(out.error is None and complete, f"stream {prompt[:24]!r} completed: {out}")
        check(out.text in reference[prompt],
              f"stream {prompt[:24]!r} has the undisturbed text\n{out.text!r}\n{reference[prompt]}")
    moved = gateway_metric(stack, "tandem:migrations_total") - migrations
    check(moved >= 1, f"the gateway migrated {moved:.0f} streams off {victim.container}")
    return victim.container


def undisturbed(client: Client) -> dict[str, set[str]]:
    """Each prompt's undisturbed greedy text, streamed one at a time and then all at once.

    They differ for a prompt whose greedy text meets a near-tie (top two logits a few hundredths
    apart) that the replica's numerics decide: each container measures its native kernels against
    PyTorch by itself at start (autotune, not cached when the machine is busy), so replicas can
    run a layer on different paths, and a stream moved to another replica can continue as that
    replica would have. Such a prompt is logged and may end in either text; every other must
    end in its one text."""
    texts: dict[str, set[str]] = {}
    solo = {p: client.stream(p, TOKENS) for p in PROMPTS}
    with concurrent.futures.ThreadPoolExecutor(len(PROMPTS)) as pool:
        together = dict(zip(PROMPTS, pool.map(lambda p: client.stream(p, TOKENS), PROMPTS)))
    for prompt in PROMPTS:
        for out in (solo[prompt], together[prompt]):
            check(out.error is None and out.completion_tokens == TOKENS, f"reference: {out}")
            texts.setdefault(prompt, set()).add(out.text)
    split = [p for p in PROMPTS if len(texts[p]) > 1]
    logger.info("replica-dependent greedy text (near-ties) for %d of %d prompts: %s",
                len(split), len(PROMPTS), split)  # fmt: skip
    check(len(split) <= len(PROMPTS) // 2, "most prompts have one undisturbed greedy text")
    return texts


def served_again(stack: Stack, client: Client, container: str) -> None:
    """Requests reach ``container`` again after its restart (its fresh metrics count them)."""
    def probe() -> bool:
        with concurrent.futures.ThreadPoolExecutor(3) as pool:
            list(pool.map(lambda p: client.stream(p, 8), PROMPTS[:3]))
        return generated(stack).get(container, 0.0) > 0
    wait_for(f"the gateway routes to the restarted {container}", probe, 300, every=0)


def kv_idle(stack: Stack) -> bool:
    return all(worker_metric(r.ip, METRICS_PORT[role], "tandem:kv_blocks_in_use") == 0
               for role in ("prefill", "decode") for r in running(stack, role))  # fmt: skip


def check_closed_by_default(stack: Stack, client: Client) -> None:
    """The gateway made an API key at its first start (no TANDEM_API_KEYS here) and printed it
    once; without it a request is 401 and ``/ready`` bare; and the gateway's container holds
    neither the CA key nor another role's key. The client uses the key from here on."""
    key = stack.compose("exec", "-T", "gateway", "cat", "/var/lib/tandem/api-keys").strip()
    check(key.startswith("sk-tandem-") and len(key) > 40, "the gateway generated no API key")
    check(stack.compose("logs", "gateway").count(key) == 1, "the key was not printed once")
    check(get_json(client.base_url + "/ready").keys() == {"status"},
          "/ready shows details without a key")  # fmt: skip
    check(client.unauthorized(), "a request without the key was not refused")
    keys = stack.compose("exec", "-T", "gateway", "sh", "-c",
                         "find / -name '*key*.pem' -not -path '/proc/*' 2>/dev/null; true")
    check(keys.split() == ["/certs/gateway-key.pem"],
          f"the gateway container can see keys other than its own: {keys.split()}")
    client.use_key(key)


def scenario(stack: Stack, client: Client) -> dict[str, float]:
    figures = {}
    offline = offline_text(PROMPTS[0])
    started = time.monotonic()
    stack.up()
    figures["healthy_s"] = stack.wait_healthy({**TOKENIZERS, "prefill": 1, "decode": 1,
                                               "gateway": 1}, timeout=900)  # fmt: skip
    check_closed_by_default(stack, client)
    wait_for("/ready lists every worker", lambda: ready_lists_every_replica(stack, client), 120)
    figures["ready_s"] = time.monotonic() - started
    compare_with_generate(client, PROMPTS[0], offline)

    started = time.monotonic()
    stack.up(SCALE)
    stack.wait_healthy({**TOKENIZERS, **SCALE, "gateway": 1}, timeout=900)
    wait_for("/ready lists all 2 prefill and 3 decode replicas by DNS",
             lambda: ready_lists_every_replica(stack, client), 120)  # fmt: skip
    figures["scale_ready_s"] = time.monotonic() - started
    spread_and_prefix_routing(stack, client)
    survive_a_tokenizer_kill(stack, client)

    reference = undisturbed(client)
    killed = kill_mid_stream(stack, client, reference, stack.kill)
    time.sleep(5)
    state = next(r.state for r in stack.replicas("decode") if r.container == killed)
    logger.info("after docker kill, %s is %s (restart policies skip a user's kill)", killed, state)
    stack.up(SCALE)  # compose starts it again
    stack.wait_healthy({**TOKENIZERS, **SCALE, "gateway": 1}, timeout=600)
    wait_for("/ready lists every replica again", lambda: ready_lists_every_replica(stack, client),
             120)  # fmt: skip
    served_again(stack, client, killed)

    crashed = kill_mid_stream(stack, client, reference, stack.crash)
    restarts = stack.restart_count(crashed)
    logger.info("%s restarted by its restart policy (RestartCount=%d)", crashed, restarts)
    stack.wait_healthy({**TOKENIZERS, **SCALE, "gateway": 1}, timeout=600)
    check(stack.restart_count(crashed) >= 1, f"compose's restart: policy restarted {crashed}")
    wait_for("/ready lists every replica again", lambda: ready_lists_every_replica(stack, client),
             120)  # fmt: skip
    served_again(stack, client, crashed)
    wait_for("every live replica's tandem:kv_blocks_in_use is 0", lambda: kv_idle(stack), 120)
    return figures


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="docker compose up, scaled and killed, for real")
    parser.add_argument("--base-image", help="BASE_IMAGE (default: python:3.11-slim if it can "
                        "be pulled, else one built by scripts/debian_base_image.sh)")
    parser.add_argument("--torch-index-url", help="TORCH_INDEX_URL (default: the CPU index if "
                        "reachable, else PyPI with a local CPU wheel)")
    parser.add_argument("--torch-wheels", type=Path, help="a directory holding the torch wheel")
    parser.add_argument("--project", default="tandem-compose-test")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                        format="%(asctime)s %(message)s", datefmt="%H:%M:%S")  # fmt: skip
    logging.getLogger("httpx").setLevel(logging.WARNING)  # the SDK's line per request
    total = time.monotonic()
    plan: BuildPlan = plan_build(REPO, args.base_image, args.torch_index_url, args.torch_wheels)
    figures = build_image(REPO, FILES, plan, IMAGE)
    port = free_port()
    stack = Stack(REPO, FILES, args.project, compose_env(port, DTYPE))
    client = Client(f"http://127.0.0.1:{port}")
    stack.down()  # a previous run's leftovers, if any
    ok = False
    try:
        figures |= scenario(stack, client)
        ok = True
    except (CheckFailed, StackError) as exc:
        logger.error("FAILED: %s\n--- last service logs ---\n%s", exc, stack.logs())
    except Exception:  # anything else, e.g. the SDK's errors: with its traceback
        logger.exception("FAILED\n--- last service logs ---\n%s", stack.logs())
    finally:
        stack.down()
    left = stack.leftovers()
    if ok:
        try:
            check(not left, f"docker compose down -v left nothing of {args.project}: {left}")
        except CheckFailed as exc:
            logger.error("FAILED: %s", exc)
            ok = False
    figures["total_s"] = time.monotonic() - total
    logger.info("figures: %s", ", ".join(f"{k}={v:.0f}" for k, v in figures.items()))
    logger.info("compose test %s", "PASSED" if ok else "FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
