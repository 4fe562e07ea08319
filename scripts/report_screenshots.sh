#!/bin/sh
# Screenshots of the newest report of each notebook, as a reader in New York sees them:
# headless Chromium (Debian's `chromium`) under TZ=America/New_York, a fresh profile per
# page, JavaScript given 20 s of virtual time to draw the charts and tables, then the
# page's blank margin trimmed (ImageMagick's `convert`).
#
#   scripts/report_screenshots.sh [REPORTS_DIR] [OUT_DIR]     # defaults: reports docs/img
#
# Needs: apt-get install chromium imagemagick. Run it after `make demo`.
set -eu
reports=$(cd "${1:-reports}" && pwd)
out=${2:-docs/img}
mkdir -p "$out"
for page in "$reports"/*/; do
    name=$(basename "$page")
    newest=$(ls "$page"*.html 2>/dev/null | sort | tail -n 1)
    [ -n "$newest" ] || continue
    profile=$(mktemp -d)
    TZ=America/New_York chromium --headless --no-sandbox --disable-gpu --disable-quic --no-first-run \
        --disable-background-networking --disable-component-update --disable-sync \
        --user-data-dir="$profile" --hide-scrollbars --window-size=1400,6000 --virtual-time-budget=20000 \
        --screenshot="$out/$name.png" "file://$newest" >/dev/null 2>&1
    rm -rf "$profile"
    convert "$out/$name.png" -trim +repage -bordercolor white -border 16 "$out/$name.png"
    echo "$out/$name.png  <-  $newest"
done
