#!/usr/bin/env bash
# The GPU check: one prepared call on one H200 that ends by itself within 420 s, process starts included, so that a
# 15-minute lease holds the machine's start, this call and a rerun. Every table row is printed the moment it is
# measured (a device call killed at its limit returns nothing it printed, and the rows it printed are what a call
# that ends returns); the table file is rewritten after every step.
#
#   bash benchmarks/gpu_wheels.sh                # here, once: .gpu_carry/ (evaluator wheels, the COCO subset)
#   bash benchmarks/gpu_check.sh                 # on the device, carrying .gpu_carry (the bare image: python3 only)
#   bash benchmarks/gpu_check.sh --quick         # the same steps on the CPU with tiny sizes: the rehearsal
#   GPU_CHECK_BUDGET=300 bash benchmarks/gpu_check.sh --steps overfit,train_run   # a rerun of some steps
#
# Steps, each in its own process group (timeout -k: TERM at its limit, KILL 5 s later), its limit the smaller of
# its own and what is left of the budget; a step with less than 20 s left is skipped with one line:
#   0. what the image lacks: the wheels in .gpu_carry/wheels installed with pip --no-index --target; one line for
#      each piece still missing (a step that needs it is skipped, never a traceback)
#   1. benchmarks/gpu_throughput.py, eager: R50-FPN RetinaNet train img/s at 800x1333 and 800x800 in fp32 / bf16 /
#      fp16, detlib vs torchvision with the same weights, peak memory, channels_last vs NCHW, the data loader
#   2. benchmarks/overfit_coco8.py (fp32 seeds 0 and 1, bf16), the three at once on the one GPU: AP, not speed
#   3. train_retinanet.py on the built-in data, --mixed_precision bf16 --compile --model_ema: the time from the
#      launch to its first logged step is the row's note
#   4. gpu_throughput.py, compiled: its own process and limit; skipped in one line when what is left of the budget
#      is under what the compile alone takes
#   5. benchmarks/tensorrt_row.py (one "skipped" line without trtexec, as on the image)
#
# $OUT (the device runner brings it back; else /tmp/detlib_gpu_check) gets at most 6 files, no folders:
#   gpu_table.md (written first, rewritten after every step), gpu_check.log (this output), gpu_results.json,
#   steps.log (the last lines of each step's own log), tensorrt.md (where TensorRT ran)
# Run folders, checkpoints and full logs stay in $DETLIB_GPU_WORK (/tmp/detlib_gpu_work).
set -uo pipefail
cd "$(dirname "$0")/.."

QUICK=""
STEPS=" eager overfit train_run compiled tensorrt "
while (( $# )); do
    case $1 in
        --quick) QUICK="--quick" ;;
        --steps) STEPS=" ${2//,/ } "; shift ;;  # a rerun of some steps: --steps overfit,train_run
        *) echo "usage: bash benchmarks/gpu_check.sh [--quick] [--steps eager,overfit,train_run,compiled,tensorrt]"; exit 2 ;;
    esac
    shift
done
want() { [[ "$STEPS" == *" $1 "* ]]; }
for s in $STEPS; do  # a misspelt step would otherwise run nothing without a word
    [[ " eager overfit train_run compiled tensorrt " == *" $s "* ]] || { echo "--steps: unknown step '$s' (eager, overfit, train_run, compiled, tensorrt)"; exit 2; }
done
[[ "${GPU_CHECK_BUDGET:-1}" =~ ^[0-9]+$ ]] || { echo "GPU_CHECK_BUDGET must be whole seconds, not '$GPU_CHECK_BUDGET'"; exit 2; }
PY=${PYTHON:-python3}
RESULTS="${OUT:-/tmp/detlib_gpu_check}"
WORK="${DETLIB_GPU_WORK:-/tmp/detlib_gpu_work}"
TABLE="$RESULTS/gpu_table.md"

if [[ -n "$QUICK" ]]; then  # the CPU: 2 cores, bf16 / fp16 kernels slow, inductor's compile minutes: eager backend
    BUDGET=${GPU_CHECK_BUDGET:-540}; T_EAGER=200; T_OVERFIT=150; T_RUN=120; T_COMPILE=60; COMPILE_NEEDS=30; T_TRT=20
    CONFIG=cpu.yaml; OVERFIT="--steps 2 --eval_every 2 --image_size 64"
    RUN="--max_steps 2 --image_size 64 --num_workers 0 --mixed_precision no --compile_backend eager"
    export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
else
    BUDGET=${GPU_CHECK_BUDGET:-400}; T_EAGER=110; T_OVERFIT=95; T_RUN=120; T_COMPILE=80; COMPILE_NEEDS=60; T_TRT=30
    CONFIG=1gpu.yaml; OVERFIT="--steps 200 --eval_every 100"
    RUN="--max_steps 60 --log_interval 10 --mixed_precision bf16"
fi

main() {
    START=$SECONDS
    echo "GPU check $(date -u +%FT%TZ), budget ${BUDGET} s${QUICK:+ (quick: the CPU rehearsal)}; work folder $WORK"
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null || echo "(no nvidia-smi)"
    prepare || { echo "== stopped: the image lacks what every step needs (above)"; finish; return 1; }

    want eager && step eager $T_EAGER "$PY" benchmarks/gpu_throughput.py $QUICK --stages eager,channels_last,loader \
        --deadline_s $(( $(limit $T_EAGER) - 10 )) --out "$WORK/gpu_results.json" --table "$TABLE"

    if [[ -n "$EVALUATOR" ]]; then
        # three runs at once: a 320 px ResNet-18 uses a sliver of an H200, and the AP, not the time, is measured
        local lim; lim=$(limit $T_OVERFIT)
        if ! want overfit; then
            :
        elif (( lim >= 20 )); then
            echo "== overfit 8 images: fp32 seeds 0 and 1, bf16, at once (limit $lim s, $(elapsed) s so far)"
            for run in fp32 fp32_seed1 bf16; do
                case $run in
                    fp32) args="--mixed_precision no --seed 0" ;;
                    fp32_seed1) args="--mixed_precision no --seed 1" ;;
                    bf16) args="--mixed_precision bf16 --seed 0" ;;
                esac
                timeout -k 5 "$lim" "$PY" benchmarks/overfit_coco8.py $OVERFIT $args --config_file $CONFIG \
                    --output_dir "$WORK/overfit_$run" --json_out "$WORK/overfit_$run.json" > "$WORK/overfit_$run.log" 2>&1 &
            done
            wait
            for run in fp32 fp32_seed1 bf16; do  # the last line that is not a progress bar
                echo "overfit $run: $(tr '\r' '\n' < "$WORK/overfit_$run.log" | grep -v -E '^ *$|it/s]' | tail -n 1)"
            done
            report
        else
            echo "== overfit 8 images: skipped, $(left) s left of the budget"
        fi

        "$PY" -c "import time, json; print(json.dumps({'time': time.time()}))" > "$WORK/train_run_start.json"
        want train_run && step train_run $T_RUN "$PY" -m accelerate.commands.launch --config_file accelerate_configs/$CONFIG \
            scripts/train_retinanet.py $RUN --compile --model_ema 0.999 --epochs 1 --report_to none \
            --num_log_images 0 --output_dir "$WORK/train_run"
    else
        echo "== overfit and train_retinanet.py: skipped, no COCO evaluator (hotcoco or pycocotools) on this image"
    fi

    if ! want compiled; then
        :
    elif (( $(left) >= COMPILE_NEEDS )); then
        step compiled $T_COMPILE "$PY" benchmarks/gpu_throughput.py $QUICK --stages compiled --append \
            --deadline_s $(( $(limit $T_COMPILE) - 5 )) --out "$WORK/gpu_results.json" --table "$TABLE"
    else
        echo "== compiled throughput: skipped, $(left) s left of the budget and its compile alone takes ~${COMPILE_NEEDS} s"
    fi

    want tensorrt && step tensorrt $T_TRT "$PY" benchmarks/tensorrt_row.py --out "$RESULTS/tensorrt.md"
    finish
}

elapsed() { echo $((SECONDS - START)); }
left() { echo $((BUDGET - (SECONDS - START))); }
# the smaller of a step's own limit and what is left of the budget
limit() { local l; l=$(left); (( l < $1 )) && echo "$l" || echo "$1"; }

# step NAME LIMIT CMD...: CMD in a process group of its own, killed whole at its limit, its output in
# $WORK/NAME.log; table rows (lines starting "| ") and skip lines pass through as they come
step() {
    local name=$1 lim; lim=$(limit "$2"); shift 2
    if (( lim < 20 )); then echo "== $name: skipped, $(left) s left of the ${BUDGET} s budget"; return; fi
    echo "== $name (limit $lim s, $(elapsed) s so far)"
    timeout -k 5 "$lim" "$@" 2>&1 | tee "$WORK/$name.log" | grep --line-buffered -E '^\| |: skipped|row skipped|^device:'
    local rc=${PIPESTATUS[0]}
    case $rc in
        0) ;;
        124|137) echo "$name: stopped at its $lim s limit; what it measured is kept" ;;
        *) echo "$name: exit $rc; last line: $(tail -n 1 "$WORK/$name.log")" ;;
    esac
    report
}

report() {  # the rows measured since the last report, and the table file rewritten
    cp -f "$WORK/gpu_results.json" "$RESULTS/" 2>/dev/null
    "$PY" benchmarks/gpu_report.py "$WORK" --update "$TABLE" || echo "(gpu_report.py failed: exit $?)"
}

prepare() {  # the folders, what the image lacks, the data; false when no step can run
    rm -rf "$WORK"
    mkdir -p "$WORK" "$RESULTS"
    echo "(the GPU check writes the table here after each step)" > "$TABLE"
    export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
    if compgen -G ".gpu_carry/wheels/*.whl" > /dev/null; then
        if "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$WORK/site" \
            .gpu_carry/wheels/*.whl > "$WORK/wheels.log" 2>&1; then
            export PYTHONPATH="$PYTHONPATH:$WORK/site"  # after the image's own packages: the wheels only add
        else
            echo "missing: the wheels in .gpu_carry/wheels did not install ($(tail -n 1 "$WORK/wheels.log"))"
        fi
    else
        echo "missing: .gpu_carry/wheels (run bash benchmarks/gpu_wheels.sh here and carry .gpu_carry)"
    fi
    local missing
    missing=$("$PY" - <<'EOF'
import importlib.util
need = {"torch": "PyTorch", "torchvision": "torchvision", "timm": "timm", "accelerate": "accelerate", "yaml": "PyYAML",
        "safetensors": "safetensors", "PIL": "Pillow", "numpy": "NumPy", "tqdm": "tqdm", "matplotlib": "matplotlib"}
for module, name in need.items():
    if importlib.util.find_spec(module) is None:
        print(f"missing: {name} (import {module}); every step needs it")
if not any(importlib.util.find_spec(m) for m in ("hotcoco", "pycocotools", "faster_coco_eval")):
    print("missing: a COCO evaluator (hotcoco or pycocotools; bash benchmarks/gpu_wheels.sh brings both)")
EOF
)
    [[ -n "$missing" ]] && echo "$missing"
    grep -q "every step needs it" <<< "$missing" && return 1
    EVALUATOR=""; grep -q "COCO evaluator" <<< "$missing" || EVALUATOR=yes
    for d in "${DETLIB_COCO_SUBSET:-}" .gpu_carry/coco_subset shared/data/coco_subset ../shared/data/coco_subset; do
        if [[ -n "$d" && -f "$d/annotations/instances_train.json" ]]; then export DETLIB_COCO_SUBSET="$(cd "$d" && pwd)"; break; fi
    done
    [[ -n "${DETLIB_COCO_SUBSET:-}" ]] || echo "missing: the COCO subset (.gpu_carry/coco_subset): images from the built-in synthetic set"
    echo "prepared in $(elapsed) s: $("$PY" -c 'import sys, torch; print(f"python {sys.version.split()[0]}, torch {torch.__version__}")')"
    return 0
}

finish() {
    report
    for f in "$WORK"/*.log; do [[ -f "$f" ]] && { echo "### $(basename "$f")"; tail -n 15 "$f"; }; done > "$RESULTS/steps.log"
    echo "== the table ($(elapsed) s)"
    cat "$TABLE"
    echo "== done in $(elapsed) s of the ${BUDGET} s budget; in $RESULTS: $(cd "$RESULTS" && ls | tr '\n' ' ')"
}

mkdir -p "$RESULTS"
main 2>&1 | tee "$RESULTS/gpu_check.log"
exit "${PIPESTATUS[0]}"
