#!/usr/bin/env bash
# The GPU check: one prepared run of at most 9 minutes on one H200 (each step's limit below comes out of a
# 525 s budget; the GPU's own start-up comes on top), then one markdown table that README and
# docs/benchmarks.md take as it is.
#
#   bash benchmarks/gpu_check.sh            # one CUDA GPU
#   bash benchmarks/gpu_check.sh --quick    # the same steps on the CPU with tiny sizes (3-6 min on 2 busy cores, 310 s measured):
#                                           # checks the script before GPU time; benchmarks/gpu_check_quick_sample.md
#
# 1. benchmarks/gpu_throughput.py: R50-FPN RetinaNet train img/s at 800x1333 and 800x800 in fp32 / bf16 / fp16,
#    detlib vs torchvision with the same weights, peak memory, channels_last vs NCHW, the data loader with 16
#    workers, eager vs torch.compile (gpu_results.json).
# 2. benchmarks/overfit_coco8.py through train_retinanet.py: the overfit-8 AP in fp32 (seeds 0 and 1: the noise)
#    and in bf16 (overfit_*.json).
# 3. train_retinanet.py on the built-in data with --mixed_precision bf16 --compile --model_ema: the scripts' new
#    flags on CUDA (train_run/).
# 4. benchmarks/gpu_report.py: the table (gpu_table.md).
# 5. benchmarks/tensorrt_row.py: TensorRT engines (fp16, INT8) built by trtexec from the ONNX export, beside PyTorch
#    eager fp16 (tensorrt.md); one "TensorRT row skipped: ..." line where there is no GPU or no trtexec.
# Results under $OUT if set (the device runner brings $OUT back), else /tmp/detlib_gpu_check.
set -uo pipefail
cd "$(dirname "$0")/.."

QUICK=""
if [[ "${1:-}" == "--quick" ]]; then QUICK="--quick"; fi
RESULTS="${OUT:-/tmp/detlib_gpu_check}"
mkdir -p "$RESULTS"
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
# the shared COCO subset where this checkout has one (shared/ travels with a worktree copied to a device machine)
for d in "shared/data/coco_subset" "../shared/data/coco_subset"; do
    if [[ -z "${DETLIB_COCO_SUBSET:-}" && -f "$d/annotations/instances_train.json" ]]; then export DETLIB_COCO_SUBSET="$PWD/$d"; fi
done
START=$SECONDS
# the smaller of a step's own limit and what is left of the budget (at least 10 s)
limit() { local left=$((BUDGET - (SECONDS - START))); (( left < $1 )) && echo $((left > 10 ? left : 10)) || echo "$1"; }

# seconds: the whole check, then each step's own limit (a CPU's bf16 / fp16 kernels are slow: longer with --quick)
if [[ -n "$QUICK" ]]; then
    BUDGET=900; T_THROUGHPUT=400; T_OVERFIT=120; T_RUN=150; T_TRT=60
    CONFIG=cpu.yaml; OVERFIT="--steps 2 --eval_every 2 --image_size 64"; SEEDS="fp32"
    RUN="--max_steps 2 --image_size 64 --num_workers 0 --mixed_precision no --compile_backend eager"
    export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
else
    BUDGET=525; T_THROUGHPUT=260; T_OVERFIT=35; T_RUN=95; T_TRT=60
    CONFIG=1gpu.yaml; OVERFIT="--steps 200 --eval_every 100"; SEEDS="fp32 fp32_seed1"
    RUN="--max_steps 60 --log_interval 20 --mixed_precision bf16"
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null || echo "(no nvidia-smi)"
fi

echo "== 1/5 throughput: detlib vs torchvision, R50-FPN  (limit $(limit $T_THROUGHPUT) s)"
timeout "$(limit $T_THROUGHPUT)" python benchmarks/gpu_throughput.py $QUICK --deadline_s $(( $(limit $T_THROUGHPUT) - 10 )) \
    --out "$RESULTS/gpu_results.json" || echo "gpu_throughput.py stopped (exit $?); what it measured is in gpu_results.json"

echo "== 2/5 overfit 8 images, fp32 and bf16  ($((SECONDS - START)) s so far)"
for run in $SEEDS bf16; do
    case $run in
        fp32) args="--mixed_precision no --seed 0" ;;
        fp32_seed1) args="--mixed_precision no --seed 1" ;;
        bf16) args="--mixed_precision bf16 --seed 0" ;;
    esac
    timeout "$(limit $T_OVERFIT)" python benchmarks/overfit_coco8.py $OVERFIT $args --config_file $CONFIG \
        --output_dir "$RESULTS/overfit_$run" --json_out "$RESULTS/overfit_$run.json" > "$RESULTS/overfit_$run.out" 2>&1
    rc=$?
    tail -n 1 "$RESULTS/overfit_$run.out"
    (( rc == 0 )) || echo "overfit $run: exit $rc (1: AP50 under its 0.8 goal; 124: time limit); see overfit_$run.out"
done

echo "== 3/5 train_retinanet.py, built-in data, --compile --model_ema  ($((SECONDS - START)) s so far)"
rm -rf "$RESULTS/train_run"
timeout "$(limit $T_RUN)" accelerate launch --config_file accelerate_configs/$CONFIG scripts/train_retinanet.py \
    $RUN --compile --model_ema 0.999 --epochs 1 --report_to none --num_log_images 0 --output_dir "$RESULTS/train_run" \
    > "$RESULTS/train_run.out" 2>&1 || echo "train_retinanet.py stopped (exit $?); see train_run.out"
tail -n 4 "$RESULTS/train_run.out"

echo "== 4/5 the table  ($((SECONDS - START)) s so far)"
python benchmarks/gpu_report.py "$RESULTS" | tee "$RESULTS/gpu_table.md"

echo "== 5/5 TensorRT from the ONNX export, fp16 and INT8  ($((SECONDS - START)) s so far)"
timeout "$(limit $T_TRT)" python benchmarks/tensorrt_row.py --out "$RESULTS/tensorrt.md" \
    || echo "tensorrt_row.py stopped (exit $?)"
echo "== done in $((SECONDS - START)) s; results in $RESULTS (gpu_table.md)"
