#!/usr/bin/env bash
# One session on a lent GPU machine (the device tool: 15 minutes in all), prepared to run once:
#   1. the tests that need CUDA (tests/pipeline/test_devices.py on the GPU, the CUDA RNG test),
#   2. benchmarks/gpu.py: D2H capture GB/s vs a plain pinned copy_ (host cache; the memory tier's registered
#      slots), blocked time in a GPU loop vs DCP, the memory tier among the methods,
#   3. benchmarks/python_bound.py on a many-core host (issue 16, goal 4),
#   4. benchmarks/restart.py: restart from the memory tier vs the node's disk, cache dropped (issue 13).
# Each part has its own time limit, so one that fails or overruns leaves the others' results. The
# machine has PyTorch but not every dependency: the wheels in .whl/ (README of the device tool) are
# installed first. Usage there:  OUT=/some/dir bash benchmarks/gpu_session.sh [parts...]
# (two calls fit one lease: `tests gpu`, then `python_bound restart` while the machine is warm).
set -u
OUT=${OUT:-/tmp/gpu-session}
RESULTS="$OUT/results"
mkdir -p "$RESULTS"
LOG="$OUT/log.txt"
export PYTHONUNBUFFERED=1
if [ -d .whl ]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
        || exit 1
    export PYTHONPATH=/tmp/site
fi
# The checkout's tierstate, laid out as installed (pipeline/, providers/, tiers/ are its subpackages).
for p in pipeline providers tiers; do ln -sfn "../../$p" "src/tierstate/$p"; done
trap 'rm -f src/tierstate/pipeline src/tierstate/providers src/tierstate/tiers' EXIT
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"  # the facade's folder: tierstate is src/tierstate

{
    echo "== machine"; nproc; free -g; df -h . /dev/shm; uptime; nvidia-smi -L
    python3 -c "import sys, torch; print(sys.version.split()[0], torch.__version__, torch.cuda.is_available() and torch.cuda.get_device_name())"
} >> "$LOG" 2>&1

part() {  # part NAME SECONDS COMMAND...: run with a limit, log its output, print one summary line
    local name=$1 limit=$2 started rc
    shift 2
    started=$(date +%s)
    echo "== $name: $*" >> "$LOG"
    timeout "$limit" "$@" >> "$LOG" 2>&1
    rc=$?
    echo "$name: rc=$rc in $(($(date +%s) - started)) s" | tee -a "$LOG"
}

PARTS=${*:-tests gpu python_bound restart}
for name in $PARTS; do
    case $name in
        tests) part tests 60 python3 -m pytest -q -p no:cacheprovider tests/pipeline/test_devices.py \
                   tests/providers/test_providers.py -k "devices or cuda" ;;
        gpu) # DCP's staging differs between torch releases (2.11's DefaultStager failed on the GPT's state):
             # three saves of each DCP variant on a small GPT, training between (2.11's stager failed at the
             # third), keep those that work there.
             dcp=$(python3 - <<'PY' 2>> "$LOG"
import sys, tempfile
from pathlib import Path
sys.path.insert(0, "benchmarks")
from harness.gpt_state import build_gpt
from harness.methods import make_checkpointer
state = build_gpt("tiny", device="cuda")
for name in ("dcp.async_save", "dcp.async_save+async-staging"):
    ckpt = make_checkpointer(name, state, Path(tempfile.mkdtemp()))
    try:
        for step in (1, 2, 3):
            ckpt.save(step)
            ckpt.wait_staged()
            state.train_step()
            ckpt.drain()
        ckpt.close()
        print("," + name, end="")
    except Exception as exc:
        print(f"{name} fails here: {exc!r}", file=sys.stderr)
PY
)
             part gpu 240 python3 benchmarks/gpu.py --capture-gb 4 --d-model 1024 --layers 8 --repeats 2 \
                 --methods "none,tierstate,tierstate(memory),torch.save$dcp" --results-dir "$RESULTS" ;;
        python_bound) part python_bound 110 python3 benchmarks/python_bound.py --repeats 5 --results-dir "$RESULTS" \
                          --methods tierstate,tierstate-1thread,floor-thread,floor-hash-thread,floor-overlap-2threads ;;
        restart) part restart 170 python3 benchmarks/restart.py --repeats 2 --results-dir "$RESULTS" ;;
        *) echo "unknown part $name" >&2; exit 2 ;;
    esac
done
cat "$RESULTS"/*.md 2>/dev/null
