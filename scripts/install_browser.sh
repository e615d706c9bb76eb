#!/usr/bin/env bash
# Install the system tools two optional test groups need: headless Chromium and its driver (the
# playground test, tests/test_playground.py) and Prometheus (the dashboard test,
# tests/test_dashboard.py). Debian packages: chromium, chromium-driver, prometheus.
# Needs apt-get and root; otherwise it prints a warning and those tests skip, saying why.
set -uo pipefail
PACKAGES=(chromium chromium-driver prometheus)
missing=()
command -v chromium >/dev/null 2>&1 || command -v chromium-browser >/dev/null 2>&1 || missing+=(chromium)
command -v chromedriver >/dev/null 2>&1 || missing+=(chromium-driver)
command -v prometheus >/dev/null 2>&1 || missing+=(prometheus)
if [ ${#missing[@]} -eq 0 ]; then
  exit 0
fi
if ! command -v apt-get >/dev/null 2>&1; then
  echo "warning: no apt-get; install ${missing[*]} yourself or the playground / Prometheus tests skip" >&2
  exit 0
fi
if [ "$(id -u)" -ne 0 ]; then
  echo "warning: not root; cannot apt-get install ${missing[*]} (the playground / Prometheus tests will skip)" >&2
  exit 0
fi
if ! (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}") >/dev/null 2>&1; then
  echo "warning: could not install ${missing[*]} (wanted: ${PACKAGES[*]})" >&2
fi
exit 0
