#!/usr/bin/env bash
# Print the Debian archive URI this machine's apt is configured with (its first "main" source
# that is not the security archive), for the scripts that fetch Debian packages outside apt
# (debootstrap, a .deb from a newer release's pool). No mirror's host is written in the
# repository: each machine uses its own sources (DEBIAN_MIRROR overrides them).
#
#   MIRROR=$(scripts/apt_mirror.sh)     exit 1 (and nothing printed) when none is configured
#
# Reads deb822 files (/etc/apt/sources.list.d/*.sources: "URIs:" / "Suites:") and one-line
# sources (/etc/apt/sources.list and *.list: "deb [options] URI SUITE COMPONENTS...").
set -euo pipefail
if [ -n "${DEBIAN_MIRROR:-}" ]; then
  echo "$DEBIAN_MIRROR"
  exit 0
fi
shopt -s nullglob
for f in /etc/apt/sources.list.d/*.sources; do
  awk 'BEGIN { RS = ""; FS = "\n" }
       {
         uris = ""; suites = ""; types = ""
         for (i = 1; i <= NF; i++) {
           if ($i ~ /^URIs:/) { uris = $i; sub(/^URIs:[ \t]*/, "", uris) }
           if ($i ~ /^Suites:/) { suites = $i; sub(/^Suites:[ \t]*/, "", suites) }
           if ($i ~ /^Types:/) { types = $i }
           if ($i ~ /^Enabled:[ \t]*no/) { next }
         }
         if (types ~ /deb( |$)/ && uris != "" && suites !~ /-security/) {
           split(uris, u, /[ \t]+/); print u[1]; exit
         }
       }' "$f"
done | head -n 1 | grep . && exit 0
for f in /etc/apt/sources.list /etc/apt/sources.list.d/*.list; do
  [ -f "$f" ] || continue
  awk '$1 == "deb" {
         i = 2
         if ($i ~ /^\[/) { while ($i !~ /\]$/ && i < NF) i++; i++ }
         if ($(i + 1) !~ /-security/) { print $i; exit }
       }' "$f"
done | head -n 1 | grep . && exit 0
exit 1
