#!/usr/bin/env bash
# What the GPU machine's bare image lacks, gathered on this machine into .gpu_carry/ (ignored by git), which the
# device call carries beside the working tree and benchmarks/gpu_check.sh reads:
#
#   .gpu_carry/wheels/        hotcoco and pycocotools (the COCO evaluators; the image has neither), no dependencies
#                             (numpy is on the image); gpu_check.sh installs them with pip --no-index --target
#   .gpu_carry/coco_subset/   the shared COCO subset (../shared beside a checkout does not travel)
#
#   bash benchmarks/gpu_wheels.sh                  # for the H200 image: CPython 3.12, manylinux x86-64
#   bash benchmarks/gpu_wheels.sh --python 3.11    # for a rehearsal of the bare image on this machine's Python
#
# then, on the device:  bash benchmarks/gpu_check.sh   (carry: [".gpu_carry"]; about 25 MB with the subset)
set -euo pipefail
cd "$(dirname "$0")/.."

PYVER=3.12
if [[ "${1:-}" == "--python" ]]; then PYVER=${2:?--python needs a version, e.g. 3.11}; fi
CARRY=.gpu_carry
# The versions the image was seen to take (issue 49): hotcoco 1.3.0 (cp310-abi3), pycocotools 2.0.11
WHEELS=(hotcoco==1.3.0 pycocotools==2.0.11)
PLATFORMS=()
for p in manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_17_x86_64 manylinux2014_x86_64 manylinux1_x86_64; do
    PLATFORMS+=(--platform "$p")
done

rm -rf "$CARRY/wheels"
mkdir -p "$CARRY/wheels"
python3 -m pip download -q --no-deps --only-binary=:all: --python-version "$PYVER" --implementation cp \
    "${PLATFORMS[@]}" -d "$CARRY/wheels" "${WHEELS[@]}"

SUBSET=""
for d in "${DETLIB_COCO_SUBSET:-}" shared/data/coco_subset ../shared/data/coco_subset; do
    if [[ -n "$d" && -f "$d/annotations/instances_train.json" ]]; then SUBSET=$d; break; fi
done
rm -rf "$CARRY/coco_subset"
if [[ -n "$SUBSET" ]]; then
    cp -r "$SUBSET" "$CARRY/coco_subset"
else
    echo "no COCO subset here (DETLIB_COCO_SUBSET, shared/data, ../shared/data): the check will use the built-in synthetic set"
fi
ls "$CARRY/wheels"
echo "$CARRY: $(du -sh "$CARRY" | cut -f1) (the device call carries at most 64 MiB with the working tree)"
