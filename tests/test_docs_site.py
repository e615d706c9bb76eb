"""The manual as a site (mkdocs.yml, docs/) and the short README in front of it.

The site builds with ``mkdocs build --strict`` and no warning at all: every page under docs/ is in
``nav``, and every link between pages, to an anchor or to an image resolves (mkdocs.yml sets each
of MkDocs' link checks to warn, and strict turns warnings into a failed build). The README, which
MkDocs does not build, is held here: at most 150 lines, the two commands first and verbatim (they
are CI's command too), and every relative link in it pointing at a file, and an anchor, that
exist.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
README = ROOT / "README.md"
COMMANDS = (
    "```bash\n"
    "scripts/install.sh && .venv/bin/tandem up\n"
    "scripts/install.sh --test && .venv/bin/python -m pytest -q\n"
    "```\n"
)
TEST_COMMAND = "scripts/install.sh --test && .venv/bin/python -m pytest -q"


def test_the_site_builds_strict_with_no_warning(tmp_path: Path) -> None:
    pytest.importorskip("mkdocs", reason="mkdocs is in the test extra: scripts/install.sh --test")
    pytest.importorskip("material", reason="mkdocs-material is in the test extra")
    done = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
        env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},  # Material's banner about its future
    )  # fmt: skip
    log = done.stdout + done.stderr
    assert done.returncode == 0, log[-4000:]
    warnings = [line for line in log.splitlines() if "WARNING" in line or "ERROR" in line]
    assert not warnings, warnings
    assert (tmp_path / "site" / "index.html").is_file()
    assert (tmp_path / "site" / "img" / "architecture.svg").is_file()
    assert (tmp_path / "site" / "img" / "grafana-dashboard.png").is_file()


def _nav_pages(nav: object) -> list[str]:
    if isinstance(nav, str):
        return [nav]
    if isinstance(nav, list):
        return [page for item in nav for page in _nav_pages(item)]
    if isinstance(nav, dict):
        return [page for value in nav.values() for page in _nav_pages(value)]
    return []


def test_every_page_is_in_nav_once() -> None:
    yaml = pytest.importorskip("yaml")

    class Loader(yaml.SafeLoader):  # mkdocs.yml names a Python slug function: keep it opaque
        pass

    Loader.add_multi_constructor("tag:yaml.org,2002:python/", lambda *_: None)
    nav = _nav_pages(yaml.load((ROOT / "mkdocs.yml").read_text(), Loader=Loader)["nav"])
    pages = sorted(str(p.relative_to(DOCS)) for p in DOCS.rglob("*.md"))
    assert sorted(nav) == pages
    assert len(nav) == len(set(nav))


def test_the_readme_is_short_and_starts_with_the_two_commands() -> None:
    text = README.read_text()
    assert len(text.splitlines()) <= 150
    first_block = text[text.index("```"):]
    assert first_block.startswith(COMMANDS), first_block[:200]
    assert text.index("```") == text.index("\n") + 2  # right under the title, nothing before


def test_ci_runs_the_readmes_test_command() -> None:
    lines = (ROOT / ".ci" / "run").read_text().splitlines()
    assert lines[-1] == TEST_COMMAND
    assert TEST_COMMAND in README.read_text()


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading (mkdocs.yml makes the site's the same)."""
    text = re.sub(r"[`*]|<[^>]+>", "", heading).strip().lower()
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def _anchors(path: Path) -> set[str]:
    text = re.sub(r"^```.*?^```", "", path.read_text(), flags=re.M | re.S)  # no code blocks
    return {_slug(m.group(1)) for m in re.finditer(r"^#{1,6} (.+?)\s*$", text, flags=re.M)}


def test_the_readmes_links_resolve() -> None:
    text = README.read_text()
    links = re.findall(r"\]\(([^)\s]+)\)", text)
    local = [link for link in links if not re.match(r"[a-z]+:", link)]
    assert len(local) >= 20, local  # the map of the docs and the figures' runs
    broken = []
    for link in local:
        target, _, anchor = link.partition("#")
        path = ROOT / target
        if not path.is_file():
            broken.append(f"{link}: no file")
        elif anchor and anchor not in _anchors(path):
            broken.append(f"{link}: no heading with that anchor")
    assert not broken, broken


def _page_links(path: Path) -> set[Path]:
    out = set()
    for link in re.findall(r"\]\(([^)\s#]+\.md)(?:#[^)]*)?\)", path.read_text()):
        target = (path.parent / link).resolve()
        if target.is_file():
            out.add(target)
    return out


def test_every_docs_page_is_within_three_clicks_of_the_readme() -> None:
    depth = {README.resolve(): 0}
    frontier = [README.resolve()]
    while frontier:
        page = frontier.pop(0)
        for target in _page_links(page):
            if target not in depth:
                depth[target] = depth[page] + 1
                frontier.append(target)
    far = [str(p.relative_to(DOCS)) for p in DOCS.glob("*.md")
           if p.name != "index.md" and depth.get(p.resolve(), 99) > 3]
    assert not far, far


def test_readme_to_a_qwen3_gguf_with_tools_behind_tls_in_compose() -> None:
    """The issue's path: README -> Deployment -> its recipe, which links what it relies on."""
    assert "docs/deployment.md#recipe-a-qwen3-gguf-with-tools-behind-https-in-compose" in (
        README.read_text())
    page = (DOCS / "deployment.md").read_text()
    recipe = page[page.index("## Recipe: a Qwen3 GGUF with tools, behind HTTPS, in compose"):]
    for needed in ("](models.md)", "](structured-outputs.md#tool-calling)",
                   "](security-setup.md)", "TANDEM_MODEL=/models/", "TANDEM_HTTPS_CERT",
                   "TANDEM_API_KEYS", "--reasoning-parser, qwen3", "compose.qwen3.yaml"):
        assert needed in recipe, needed


def test_the_recipes_compose_override_renders(tmp_path: Path) -> None:
    """The recipe's override file, merged over compose.yaml by ``docker-compose config``: the
    model folder and the HTTPS files are mounted next to the certificates, not instead of them."""
    binary = shutil.which("docker-compose")
    if binary is None:
        if os.environ.get("TANDEM_REQUIRE_COMPOSE"):  # set by .ci/run
            pytest.fail("docker-compose is required on CI (apt-get install -y docker-compose)")
        pytest.skip("docker-compose is not installed (CI: apt-get install -y docker-compose)")
    yaml = pytest.importorskip("yaml")
    page = (DOCS / "deployment.md").read_text()
    recipe = page[page.index("## Recipe: a Qwen3 GGUF"):]
    override = re.search(r"```yaml\n(.*?)```", recipe, flags=re.S).group(1)
    (tmp_path / "compose.qwen3.yaml").write_text(override)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TANDEM_", "COMPOSE_"))}
    env.update(TANDEM_MODEL="/models/Qwen3-0.6B-Q4_K_M.gguf", TANDEM_API_KEYS="sk-mykey",
               TANDEM_ALLOW_NO_AUTH="0", TANDEM_BIND="0.0.0.0")
    done = subprocess.run(
        [binary, "-f", str(ROOT / "compose.yaml"), "-f", str(tmp_path / "compose.qwen3.yaml"),
         "config"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    services = yaml.safe_load(done.stdout)["services"]

    def mounts(name: str) -> set[str]:
        return {v["target"] if isinstance(v, dict) else v.split(":")[1]
                for v in services[name]["volumes"]}

    for name in ("tokenizer", "prefill", "decode"):
        assert mounts(name) == {"/certs", "/models"}, name
        assert services[name]["environment"]["TANDEM_MODEL"] == env["TANDEM_MODEL"]
    gateway = services["gateway"]
    assert mounts("gateway") == {"/certs", "/models", "/https", "/var/lib/tandem"}  # + API key
    assert gateway["environment"]["TANDEM_HTTPS_CERT"] == "/https/cert.pem"
    assert gateway["environment"]["TANDEM_TLS_CERT"] == "/certs/gateway.pem"  # mTLS kept
    assert gateway["environment"]["TANDEM_API_KEYS"] == "sk-mykey"
    command = gateway["command"]
    assert command[command.index("--model") + 1] == env["TANDEM_MODEL"]
    assert command[command.index("--reasoning-parser") + 1] == "qwen3"
    assert "9102" in " ".join(gateway["healthcheck"]["test"])
