#!/usr/bin/env bash
# Every wheel an offline `pip install --no-index --find-links DIR 'od-moe[cuda13]'` needs, for CPython 3.12
# on manylinux x86_64, downloaded into DIR: od-moe's own wheel built from this checkout, and its dependency
# closure from the package index pip is set up for. An investigation script for the device proof of issue
# #54 item 5, not part of od-moe; it prints the bundle's size, in all and without NVIDIA's CUDA libraries
# (nvidia-*, which a machine's system Python may already hold), and its largest wheels.
#
#     lab/cuda_install/download_wheels.sh DIR [EXTRAS]   # EXTRAS: cuda13 unless given (cuda12; cuda13,test)
#
# DIR must be new or hold no wheels; lab/cuda_install/wheels/ is ignored by git. Then, on the device:
#     python3.12 -m venv v && v/bin/pip install --no-index --find-links DIR 'od-moe[cuda13]'
set -euo pipefail
dest=${1:?usage: $0 DIR [EXTRAS]}
extras=${2:-cuda13}
root=$(cd "$(dirname "$0")/../.." && pwd)
mkdir -p "$dest"
dest=$(cd "$dest" && pwd)
# a folder of its own: wheels left from another run would be counted, and offered to the install
if compgen -G "$dest/*.whl" >/dev/null; then
    echo "$dest already holds wheels: give a new or empty folder" >&2
    exit 2
fi

python3 -m pip wheel -q --no-deps -w "$dest" "$root"
wheel=$(ls "$dest"/od_moe-*.whl)

# mlx-cuda-12 and -13 are tagged manylinux_2_35 (glibc 2.35), so the target needs at least that glibc;
# pip does not widen a manylinux_2_X --platform to older tags by itself, so each one is named.
platforms=()
for minor in $(seq 35 -1 17); do platforms+=(--platform "manylinux_2_${minor}_x86_64"); done
platforms+=(--platform manylinux2014_x86_64)
python3 -m pip download -q -d "$dest" --only-binary=:all: --python-version 3.12 --implementation cp \
    --abi cp312 --abi abi3 --abi none "${platforms[@]}" "od-moe[$extras] @ file://$wheel"

size() { if [ $# -gt 0 ]; then du -cm "$@" | tail -n 1 | cut -f1; else echo 0; fi; }
shopt -s nullglob
all=("$dest"/*.whl)
nvidia=("$dest"/nvidia_*.whl)
echo "${#all[@]} wheels in $dest: $(size "${all[@]}") MiB in all, $(size "${nvidia[@]}") MiB of them" \
    "in ${#nvidia[@]} nvidia-* wheels. Largest (MiB):"
ls -S "$dest" | head -n 15 | while read -r name; do printf '%6s  %s\n' "$(size "$dest/$name")" "$name"; done
