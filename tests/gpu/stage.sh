#!/usr/bin/env bash
# Device side, every call: keep the payload parts this call carried (.gpu/pN) outside the
# working tree, which a warm machine keeps between calls; once all parts are there, check
# the sha256 and install: vLLM and the carried wheels into $GPU_STAGE/site.
set -euo pipefail
S=${GPU_STAGE:-/root/stage}
mkdir -p "$S/parts"
for f in .gpu/p*/payload.part.*; do [[ -f $f ]] && cp "$f" "$S/parts/"; done
want=$(cat .gpu/bin/parts)
have=$(find "$S/parts" -name 'payload.part.*' | wc -l)
echo "staged $have/$want parts"
[[ -f $S/ready || $have -lt $want ]] && exit 0
t0=$(date +%s)
cat "$S"/parts/payload.part.* > "$S/payload.tar"
[[ $(sha256sum "$S/payload.tar" | cut -d' ' -f1) == $(cat .gpu/bin/payload.sha256) ]] \
    || { echo "payload sha256 mismatch"; rm -f "$S"/parts/*; exit 4; }
mkdir -p "$S/payload" "$S/site"
tar -xf "$S/payload.tar" -C "$S/payload" && rm -f "$S/payload.tar" "$S"/parts/*
python3 -c "import sys, tarfile; tarfile.open(sys.argv[1], 'r:xz').extractall(sys.argv[2], filter='tar')" \
    "$S/payload/vllm.tar.xz" "$S/site"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$S/site" \
    "$S"/payload/whl/*.whl
touch "$S/ready"
echo "installed in $(( $(date +%s) - t0 )) s"
