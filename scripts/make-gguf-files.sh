#!/usr/bin/env bash
# GGUF files of SmolLM2-135M-Instruct made with llama.cpp's own tools, for benchmarks/compare.py
# --gguf. Benchmark-only: never run by the tests or CI. Needs scripts/build-llama-cpp.sh DEST first.
#
#   scripts/make-gguf-files.sh DEST [TYPES]      # run from the repository root; TYPES default
#                                                # "Q4_0 Q8_0 Q4_K_M Q5_K_M"
#
# No original SmolLM2 weights can be downloaded here, so it starts from the bundled Q4_1 GGUF:
# kvserve's loader dequantizes it into a Hugging Face folder (transformers `from_pretrained(...,
# gguf_file=...)`, `save_pretrained`, the tokenizer), the vendored convert_hf_to_gguf.py (with the
# vendored gguf-py) writes F16, and llama-quantize makes each type from F16. Also a draft model for
# speculative decoding: the first DRAFT_LAYERS (default 8) layers, Q8_0. Prints each file's tensor
# type histogram. Output in DEST/models. About 2-4 minutes on 2 cores.
set -euo pipefail

DEST=${1:?usage: $0 DEST [TYPES] (DEST as given to scripts/build-llama-cpp.sh)}
TYPES=${2:-Q4_0 Q8_0 Q4_K_M Q5_K_M}
DRAFT_LAYERS=${DRAFT_LAYERS:-8}
PYTHON=${PYTHON:-python}
DEST=$(cd "$DEST" && pwd)
src=$DEST/src/vendor/llama.cpp
quantize=$DEST/build/bin/llama-quantize
models=$DEST/models
[[ -x $quantize ]] || { echo "no $quantize: run scripts/build-llama-cpp.sh $DEST first" >&2; exit 1; }
[[ -f $src/convert_hf_to_gguf.py ]] || { echo "no $src: run scripts/build-llama-cpp.sh first" >&2; exit 1; }
mkdir -p "$models"
name=SmolLM2-135M-Instruct
start=$(date +%s)

echo "== dequantizing the bundled GGUF into a Hugging Face folder (kvserve's loader)"
hf=$("$PYTHON" -c 'from engine.models.loader import resolve_model; print(resolve_model(None))')
echo "   $hf"

# The converter imports sentencepiece even for a tokenizer.json-only model: kept in DEST/pydeps,
# outside the repository's environment.
pydeps=$DEST/pydeps
if ! "$PYTHON" -c 'import sentencepiece' 2>/dev/null && [[ ! -d $pydeps/sentencepiece ]]; then
    "$PYTHON" -m pip install --quiet --target "$pydeps" sentencepiece
fi
convert() {  # HF folder -> F16 GGUF with the vendored converter
    PYTHONPATH="$src/gguf-py:$pydeps${PYTHONPATH:+:$PYTHONPATH}" nice -n 10 "$PYTHON" \
        "$src/convert_hf_to_gguf.py" "$1" --outtype f16 --outfile "$2"
}
f16=$models/$name-F16.gguf
[[ -f $f16 ]] || convert "$hf" "$f16"
for t in $TYPES; do
    out=$models/$name-$t.gguf
    [[ -f $out ]] || nice -n 10 "$quantize" "$f16" "$out" "$t" 2
done

echo "== draft model: the first $DRAFT_LAYERS layers"
draft_hf=$models/$name-first$DRAFT_LAYERS-hf
draft=$models/$name-first$DRAFT_LAYERS-Q8_0.gguf
if [[ ! -f $draft ]]; then
    "$PYTHON" -c "
import sys
from pathlib import Path
from benchmarks.spec_decode import first_layers_checkpoint
first_layers_checkpoint(Path(sys.argv[1]), int(sys.argv[2]), Path(sys.argv[3]))
" "$hf" "$DRAFT_LAYERS" "$draft_hf"
    convert "$draft_hf" "$models/$name-first$DRAFT_LAYERS-F16.gguf"
    nice -n 10 "$quantize" "$models/$name-first$DRAFT_LAYERS-F16.gguf" "$draft" Q8_0 2
    rm -rf "$draft_hf" "$models/$name-first$DRAFT_LAYERS-F16.gguf"
fi

echo "== made in $(($(date +%s) - start)) s; tensor types per file:"
"$PYTHON" -m benchmarks.gguf_files "$f16" $(for t in $TYPES; do echo "$models/$name-$t.gguf"; done) "$draft"
