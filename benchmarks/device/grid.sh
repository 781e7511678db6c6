#!/usr/bin/env bash
# Run THERE (the GPU machine), after benchmarks/device/prepare.sh here. The device tool removes, at
# each call, every ignored folder that call does not carry, so what must outlast the first call goes
# outside the repository: the first call (carrying .whl, .devdata and .gguf_a) installs the wheels
# into /tmp/site and copies the first part of the weights to /tmp/parts; the second (carrying
# .gguf_b and .devdata, while the machine is still warm) joins the parts, checks the file's hash,
# and runs benchmarks/grid.py on CUDA. The row for benchmarks/RESULTS.md and the log come back in
# $OUT. Extra arguments go to grid.py (default: the quick profile of paper_main; a later --spec wins).
# SMOKE=1: no weights needed; the same grid on tiny-gpt2 with 4 evaluation documents, to see in a
# minute that the packages, CUDA and every job kind work there before the long call. FLOPS=0: no FLOP
# counting (the count is a property of the work, measured on the CPU; counting adds per-op overhead).
#
# Locally, to try the script on the CPU: PY=.venv/bin/python WHEELS= OUT=/tmp/out \
#   bash benchmarks/device/grid.sh --device cpu --profile main-test --override documents.n_eval=4
set -euo pipefail
cd "$(dirname "$0")/../.."
PY=${PY:-python3}
WHEELS=${WHEELS-.whl}
OUT=${OUT:?set OUT to a folder for the results}
export PYTHONUNBUFFERED=1
if [ -n "$WHEELS" ] && [ -d "$WHEELS" ]; then
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site "$WHEELS"/*.whl
fi
[ -d /tmp/site ] && export PYTHONPATH="/tmp/site${PYTHONPATH:+:$PYTHONPATH}"
if [ -f .gguf_a/part00 ]; then mkdir -p /tmp/parts && cp .gguf_a/part00 /tmp/parts/part00; fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
FLOPS=${FLOPS:-1}
flops=(); [ "$FLOPS" = 1 ] && flops=(--flops)
if [ "${SMOKE:-0}" = 1 ]; then
  "$PY" -c "import torch; print('torch', torch.__version__, 'cuda', torch.cuda.is_available())"
  "$PY" benchmarks/grid.py --spec paper_main "${flops[@]}" --override 'model=[tiny-gpt2]' \
    --override "data.path=$PWD/.devdata/wikitext-2-raw" --override documents.n_eval=4 \
    "$@" 2>&1 | grep --line-buffered -v -E "it/s\]|s/it\]" | tee "$OUT/smoke.log"
  exit "${PIPESTATUS[0]}"
fi
if [ ! -f /tmp/parts/part00 ] || [ ! -f .gguf_b/part01 ]; then
  echo "the two parts of the weights are not both here: carry .gguf_a in one call and, while the machine" \
       "is still warm, .gguf_b in the next (see benchmarks/device/prepare.sh)" >&2
  exit 2
fi
mkdir -p /tmp/smollm2
cat /tmp/parts/part00 .gguf_b/part01 > /tmp/smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
echo "$(cat .gguf_b/sha256)  /tmp/smollm2/SmolLM2-135M-Instruct.Q4_1.gguf" | sha256sum -c -
"$PY" -c "import torch; print('torch', torch.__version__, 'cuda', torch.cuda.is_available(), torch.cuda.get_device_name(0) if torch.cuda.is_available() else '')"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv 2>/dev/null || true
args=("$@")
[ ${#args[@]} -gt 0 ] || args=(--device cuda --workers 1 --threads 4)
has_profile=0; for a in "${args[@]}"; do [ "$a" = --profile ] && has_profile=1; done
[ $has_profile = 1 ] || args+=(--profile quick)
"$PY" benchmarks/grid.py --spec paper_main "${flops[@]}" \
  --override model_path=/tmp/smollm2 --override "data.path=$PWD/.devdata/wikitext-2-raw" \
  "${args[@]}" 2>&1 | grep --line-buffered -v -E "it/s\]|s/it\]" | tee "$OUT/grid.log"
grep '^| ' "$OUT/grid.log" > "$OUT/row.md" || true
