#!/usr/bin/env bash
# Build llama.cpp's llama-server, llama-quantize and llama-perplexity for benchmarks/compare.py, from
# the llama.cpp copy vendored in the llama-cpp-python source distribution on PyPI. Benchmark-only:
# never run by the tests or CI.
#
#   scripts/build-llama-cpp.sh DEST     # e.g. ~/llama.cpp-bench (outside the repository)
#
# DEST/llama_cpp_python-*.tar.gz is used if present, else downloaded there with
# `pip download --no-deps --no-binary :all: llama-cpp-python`. The source goes to DEST/src, the build
# to DEST/build (binaries in DEST/build/bin). CMake Release, GGML_NATIVE=OFF, and each x86 ISA option
# switched on only when /proc/cpuinfo lists every flag it compiles for. AMX stays OFF whatever cpuid
# says: some Xeons advertise amx_tile/amx_int8 but trap on `tilezero`. No CURL, no OpenSSL, no web UI
# download. Runs `nice -n 10` with -j2 (JOBS=N to change). About 10-15 minutes on 2 shared cores.
# MAX_ISA=avx2 builds as for a CPU without AVX-512 or VNNI (an AVX2-only machine's llama.cpp, beside
# kvserve run with KVSERVE_BLOCK_KERNELS=avx2 ATEN_CPU_CAPABILITY=avx2 --kv-cache-dtype float16;
# README, "Against llama.cpp's server on the same CPU").
set -euo pipefail

DEST=${1:?usage: $0 DEST (folder for the sdist, source and build, outside the repository)}
JOBS=${JOBS:-2}
if [[ -n ${MAX_ISA:-} && $MAX_ISA != avx2 ]]; then
    echo "MAX_ISA: only avx2 is known, not '$MAX_ISA'" >&2
    exit 2
fi
PYTHON=${PYTHON:-python3}
mkdir -p "$DEST"
DEST=$(cd "$DEST" && pwd)

sdist=$(ls -t "$DEST"/llama_cpp_python-*.tar.gz 2>/dev/null | head -n1 || true)
if [[ -z $sdist ]]; then
    echo "== downloading the llama-cpp-python sdist into $DEST"
    "$PYTHON" -m pip download --no-deps --no-binary :all: llama-cpp-python -d "$DEST"
    sdist=$(ls -t "$DEST"/llama_cpp_python-*.tar.gz | head -n1)
fi
top=$(basename "$sdist" .tar.gz)
src=$DEST/src/vendor/llama.cpp
if [[ ! -f $src/CMakeLists.txt || $(cat "$DEST/src/.sdist" 2>/dev/null) != "$top" ]]; then
    echo "== extracting $top/vendor/llama.cpp into $DEST/src"
    rm -rf "$DEST/src"
    mkdir -p "$DEST/src"
    tar xzf "$sdist" -C "$DEST/src" --strip-components=1 "$top/vendor/llama.cpp"
    echo "$top" >"$DEST/src/.sdist"
fi

# cmake option -> the cpuinfo flags it compiles for (all must be present)
flags=" $(grep -m1 -E '^(flags|Features)' /proc/cpuinfo | cut -d: -f2) "
if [[ ${MAX_ISA:-} == avx2 ]]; then  # drop every flag past AVX2 (AVX-512*, VNNI, AMX)
    flags=" $(tr ' ' '\n' <<<"$flags" | grep -v -E '^(avx512|avx_vnni|amx)' | tr '\n' ' ') "
fi
has() { for f in "$@"; do [[ $flags == *" $f "* ]] || return 1; done; }
isa=()
on=()
add() {
    local opt=$1
    shift
    if has "$@"; then isa+=("-D$opt=ON"); on+=("$opt"); else isa+=("-D$opt=OFF"); fi
}
add GGML_SSE42 sse4_2
add GGML_AVX avx
add GGML_AVX2 avx2
add GGML_BMI2 bmi2
add GGML_FMA fma
add GGML_F16C f16c
add GGML_AVX512 avx512f avx512cd avx512vl avx512dq avx512bw
add GGML_AVX512_VBMI avx512f avx512vbmi
add GGML_AVX512_VNNI avx512f avx512_vnni
add GGML_AVX512_BF16 avx512f avx512_bf16
add GGML_AVX_VNNI avx_vnni
isa+=(-DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF)

cpu=$(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | sed 's/^ *//')
echo "== CPU: $cpu, $(nproc) cores"
echo "== ISA options ON: ${on[*]:-none} (AMX OFF)"
echo "${on[*]:-none}" >"$DEST/build-isa.txt"

cmake_args=(
    -S "$src" -B "$DEST/build" -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=OFF "${isa[@]}"
    -DBUILD_SHARED_LIBS=OFF -DLLAMA_OPENSSL=OFF -DLLAMA_BUILD_UI=OFF -DLLAMA_USE_PREBUILT_UI=OFF
    -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_APP=OFF
)
# LLAMA_CURL is an option only in older llama.cpp (newer ones warn that it is gone)
if grep -q 'option(LLAMA_CURL' "$src/CMakeLists.txt"; then cmake_args+=(-DLLAMA_CURL=OFF); fi
echo "== cmake ${cmake_args[*]}"
start=$(date +%s)
nice -n 10 cmake "${cmake_args[@]}"
nice -n 10 cmake --build "$DEST/build" --config Release -j "$JOBS" \
    --target llama-server llama-quantize llama-perplexity
echo "== built in $(($(date +%s) - start)) s:"
ls -l "$DEST"/build/bin/llama-server "$DEST"/build/bin/llama-quantize "$DEST"/build/bin/llama-perplexity
"$DEST/build/bin/llama-server" --version 2>&1 | tail -n 2 || true
