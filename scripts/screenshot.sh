#!/usr/bin/env bash
# Renders an HTML page (e.g. the demo's gallery) in headless Chromium and saves a PNG screenshot, to check what a
# browser shows (images decoded, layout) rather than grepping the HTML.
#   bash scripts/screenshot.sh demo_work/doc.html demo_work/doc.png [1200,1600]
# Needs chromium (Debian: apt-get install -y chromium).
set -euo pipefail
if [ $# -lt 2 ]; then
  echo "usage: bash scripts/screenshot.sh PAGE.html OUT.png [WIDTH,HEIGHT]" >&2
  exit 2
fi
page=$(realpath "$1")
out=$(realpath -m "$2")
size=${3:-1200,1600}
browser=$(command -v chromium || command -v chromium-browser || command -v google-chrome || true)
if [ -z "$browser" ]; then
  echo "screenshot.sh: no chromium on PATH (Debian: apt-get install -y chromium)" >&2
  exit 2
fi
# --no-sandbox: containers run as root, where Chromium's sandbox refuses to start.
"$browser" --headless --no-sandbox --disable-gpu --hide-scrollbars --screenshot="$out" --window-size="$size" \
  "file://$page" 2>/dev/null
[ -s "$out" ] && echo "wrote $out"
