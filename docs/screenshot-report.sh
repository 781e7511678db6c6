#!/usr/bin/env bash
# Render an audit's self-contained report.html in headless Chromium and save a PNG of it, for the docs.
#
#   docs/screenshot-report.sh AUDIT_DIR [OUT.png] [HEIGHT]
#
# Needs Chromium (Debian: apt-get install chromium). The page loads nothing from outside (CSS inline,
# figures embedded), so the screenshot is the report as a reader opens it. HEIGHT is the window
# height in pixels (default 5200); Chromium captures the window, not the whole page.
set -euo pipefail
dir=${1:?usage: docs/screenshot-report.sh AUDIT_DIR [OUT.png] [HEIGHT]}
page="$(cd "$dir" && pwd)/report.html"
out=${2:-$dir/report.png}
height=${3:-5200}
[ -f "$page" ] || { echo "error: $page does not exist; run splitleak audit --out $dir first" >&2; exit 2; }
browser=$(command -v chromium || command -v chromium-browser || command -v google-chrome || true)
[ -n "$browser" ] || { echo "error: no Chromium found; install it (Debian: apt-get install chromium)" >&2; exit 2; }
# --no-sandbox: Chromium refuses to run as root otherwise; the page is our own file and runs no script
"$browser" --headless --no-sandbox --disable-gpu --hide-scrollbars --disable-javascript \
  --window-size="1280,$height" --screenshot="$out" "file://$page" 2>/dev/null
[ -s "$out" ] || { echo "error: Chromium wrote no screenshot to $out" >&2; exit 1; }
echo "screenshot: $out"
