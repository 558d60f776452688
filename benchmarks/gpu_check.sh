#!/usr/bin/env bash
# A lent GPU's checks in one command (issue 14), for the device machine's image, whose
# python3 already holds a CUDA build of torch: install Djinn and the wheels it lacks
# there (carried in .whl/, README "GPU checks"; py-spy's too, for the profile), then the
# gpu-marked tests, the GPU benchmark, the transport benchmark, replay_profile.py and
# test_failures_stay_local.py on GPU workers. Each
# step has its own time limit so that a hang costs one step, and every log lands in $OUT
# (or /tmp/gpu_check). With PACK=1 they end up in one archive, $OUT/gpu_check.tgz: the
# device tool brings back only a few files from $OUT (stop 40 lost py-spy's raw records).
#
#     bash benchmarks/gpu_check.sh [pytest args for an extra test run]
#     SKIP="transport" bash benchmarks/gpu_check.sh   # steps named in SKIP are left out
#     PACK=1 bash benchmarks/gpu_check.sh             # on the device machine: one archive
set -u
OUT=${OUT:-/tmp/gpu_check}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
unset DJINN_ADDRESS
step() {  # step NAME SECONDS CMD...: run CMD with a limit, its output in $OUT/NAME.txt
    local name=$1 limit=$2
    case " ${SKIP:-} " in *" $name "*) echo "== $name: skipped"; return ;; esac
    shift 2
    echo "== $name (limit ${limit}s): $*"
    local t0=$SECONDS
    timeout -k 10 "$limit" "$@" >"$OUT/$name.txt" 2>&1
    echo "== $name: exit $? after $((SECONDS - t0))s"
    tail -n 60 "$OUT/$name.txt"
}
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv
python3 -c 'import torch; print("torch", torch.__version__, "cuda", torch.version.cuda)'
if [ -d .whl ]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir .whl/*.whl
fi
python3 -m pip install -q --no-index --no-deps --no-build-isolation -e . >/dev/null
python3 -c 'import djinn; print("djinn imports from", djinn.__file__)' 2>&1 | tail -3
step gpu_tests 150 python3 -m pytest -n 0 -m gpu -p no:cacheprovider -q -rfE --timeout 120 \
    tests/integration/test_gpu.py tests/unit/test_tiers.py tests/unit/test_cuda_graphs.py
step gpu_bench 240 python3 benchmarks/gpu.py --json "$OUT/gpu.json"
step transport 90 python3 benchmarks/transport.py --quick --json "$OUT/transport.json"
# where a replayed training step's time goes (worker and client sampled if py-spy is there)
SPY=$(command -v py-spy || true)
step replay_profile 90 python3 benchmarks/replay_profile.py --seconds 6 ${SPY:+--py-spy "$SPY"} \
    --json "$OUT/replay_profile.json"
# the same for the default Adam (followed steps), and for a put+get of 16 bytes and of
# 1 MiB (a GPU host's transport is 2-3x slower than a CPU worker's); py-spy's raw records
# are kept in $OUT/raw_* for a look at whole stacks
profiled() {  # profiled NAME ARGS...: replay_profile.py with ARGS as step NAME
    local name=$1
    shift
    step "$name" 90 python3 benchmarks/replay_profile.py --seconds 4 "$@" \
        ${SPY:+--py-spy "$SPY" --raw "$OUT/raw_$name"} --json "$OUT/$name.json"
}
# the default Adam's followed steps both ways (Note [steps followed while the graph runs]):
# sent ahead of the following (what auto takes on a GPU) and the whole call after it
DJINN_FOLLOW_AHEAD=always profiled adam_profile --workload adam
DJINN_FOLLOW_AHEAD=never profiled adam_after_profile --workload adam
# the default Adam on the encoder with dropout (auto): its draws replayed (Note [replayed
# draws]), and its forward and backward never a CUDA graph (a random op)
profiled adam_dropout_profile --workload adam --dropout 0.1
profiled tiny_profile --workload put_get
profiled mib_profile --workload put_get --nbytes 1048576
# one failed op breaks nothing else, on GPU workers: a bad index answered without a restart
DJINN_TEST_GPUS=auto step failures_on_gpu 100 python3 -m pytest -n 0 -p no:cacheprovider -q -rfE \
    --timeout 120 tests/integration/test_failures_stay_local.py
if [ $# -gt 0 ]; then
    step extra_tests ${EXTRA_LIMIT:-400} python3 -m pytest -n 0 -p no:cacheprovider -q -rfE --timeout 120 "$@"
fi
if [ "${PACK:-0}" = 1 ]; then
    tar -czf /tmp/gpu_check.tgz -C "$OUT" . && rm -rf "${OUT:?}"/* && mv /tmp/gpu_check.tgz "$OUT/"
    echo "== packed: $OUT/gpu_check.tgz"
fi
