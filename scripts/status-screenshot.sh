#!/usr/bin/env bash
# A PNG of a relay's status page, rendered by headless Chromium after the page's script
# refreshed it from /status.json, so a person can look at it (docs/operations.md, "Status page").
#
#   scripts/status-screenshot.sh URL [OUT.png]
#   scripts/status-screenshot.sh http://127.0.0.1:9187/ status.png
#   STATUS_TOKEN=... scripts/status-screenshot.sh http://127.0.0.1:9187/   # metrics.status_token
#
# Chromium: Debian package `chromium` (scripts/deps.sh installs it).
set -euo pipefail
url="${1:?usage: $0 URL [OUT.png]}"
out="${2:-status.png}"
browser="$(command -v chromium || command -v chromium-browser || true)"
if [ -z "$browser" ]; then
  echo "chromium is not installed: apt-get install chromium (or run scripts/deps.sh)" >&2
  exit 1
fi
if [ -n "${STATUS_TOKEN:-}" ]; then
  case "$url" in *\?*) url="$url&token=$STATUS_TOKEN" ;; *) url="$url?token=$STATUS_TOKEN" ;; esac
fi
profile="$(mktemp -d)"
trap 'rm -rf "$profile"' EXIT
# --no-sandbox: Chromium refuses to run as root with its sandbox (CI containers run as root).
timeout 90 "$browser" --headless --no-sandbox --disable-gpu --disable-dev-shm-usage \
  --no-first-run --hide-scrollbars --user-data-dir="$profile" \
  --virtual-time-budget=4000 --window-size=1200,1500 \
  --screenshot="$(realpath -m "$out")" "$url" >/dev/null 2>&1
[ -s "$out" ] || { echo "no screenshot written to $out" >&2; exit 1; }
echo "$out"
