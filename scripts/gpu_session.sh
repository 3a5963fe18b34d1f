#!/usr/bin/env bash
# One GPU session's checks and timings in one call, every output under $OUT (default: ./gpu-session-out):
#
#   bash scripts/gpu_session.sh tests            # the GPU suite (python -m pytest -m gpu tests/gpu): 531-683 s on H200s
#   bash scripts/gpu_session.sh tests-stacks     # the suite in two parts of roughly half its time each, for calls
#   bash scripts/gpu_session.sh tests-ops        #   limited to 10 minutes: the models and stacks; all the other files
#   bash scripts/gpu_session.sh fp8              # FP8 SMC-SD at 1 and 16 requests, and 16 requests over
#                                                # 2,048-token prompts with and without the shared-prefix pass
#   bash scripts/gpu_session.sh attention        # the attention planner's sweeps and the particles' cascade
#   bash scripts/gpu_session.sh tp               # tensor parallelism (2+ GPUs): TP tests, all-reduce, decode and
#                                                # the SMC cycle at TP = 1 and 2
#   bash scripts/gpu_session.sh tests fp8        # parts run in the order given
#
# The GPU machines have no package registry: wheels hsmc needs that their Python lacks (omegaconf >= 2.4 and its
# antlr4-python3-runtime 4.9.3) are installed from ./.whl when that folder is there (gitignored; carry it).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/gpu-session-out}
mkdir -p "$OUT"
if compgen -G ".whl/*.whl" > /dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/hsmc-wheels .whl/*.whl
    export PYTHONPATH=$PWD:/tmp/hsmc-wheels${PYTHONPATH:+:$PYTHONPATH}
else
    export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
fi
export HF_HUB_OFFLINE=1

run() {  # run NAME COMMAND...: the command's output in $OUT/NAME.txt, its exit status as its last line
    local name=$1
    shift
    echo "== $name: $*"
    "$@" > "$OUT/$name.txt" 2>&1
    local rc=$?
    echo "rc=$rc" >> "$OUT/$name.txt"
    tail -n 4 "$OUT/$name.txt"
}

STACK_TESTS=(tests/gpu/test_models_on_cuda.py tests/gpu/test_stacks_on_cuda.py tests/gpu/test_smc_stacks_on_cuda.py)
nvidia-smi --query-gpu=index,name,memory.total,driver_version --format=csv > "$OUT/gpus.txt"
cat "$OUT/gpus.txt"
for part in "${@:-tests}"; do
    case $part in
    tests)
        run gpu-tests python3 -m pytest -q -m gpu tests/gpu -p no:cacheprovider --durations=15
        ;;
    tests-stacks)
        run gpu-tests-stacks python3 -m pytest -q -m gpu "${STACK_TESTS[@]}" -p no:cacheprovider --durations=15
        ;;
    tests-ops)
        run gpu-tests-ops python3 -m pytest -q -m gpu tests/gpu "${STACK_TESTS[@]/#/--ignore=}" -p no:cacheprovider \
            --durations=15
        ;;
    fp8)
        run fp8-routes python3 scripts/bench_fp8_routes.py --batch 1,16 --out "$OUT/fp8-routes"
        run fp8-long-prompts python3 scripts/bench_fp8_routes.py --batch 16 --prompt-tokens 2048 --row-by-row \
            --out "$OUT/fp8-long-prompts"
        ;;
    attention)
        (cd scripts && run attention-particles python3 bench_attention.py --parts particles --out "$OUT/attention")
        (cd scripts && run attention-sweeps python3 sweep_kernels.py --parts attention,shared-prefix \
            --out "$OUT/attention")
        ;;
    tp)
        run tp-tests python3 -m pytest -q -m gpu tests/gpu/test_tensor_parallel_on_cuda.py -p no:cacheprovider
        run tp-decode python3 scripts/bench_tensor_parallel.py --parts all-reduce,decode --out "$OUT/tp"
        for tp in 1 2; do
            run "tp$tp-smc-cycle" python3 -m hsmc.cli bench --config configs/bench/smc_8b_32b.yaml --batch 1 \
                --new-tokens 128 levels.1.num_layers=40 "engine.tensor_parallel=$tp"
        done
        ;;
    *)
        echo "unknown part '$part' (tests, tests-stacks, tests-ops, fp8, attention, tp)" >&2
        exit 2
        ;;
    esac
done
