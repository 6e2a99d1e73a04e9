#!/usr/bin/env bash
# The GPU checks of a session lent a CUDA machine, as the one command the device tool runs
# there (a session has 15 device minutes in all, starts included; docs/gpu-fast-path.md,
# "A lent GPU session"). Made here first: `python -m load.gpu_kit` (wheels in .whl/, the
# default model's tokenizer and config in .gpu-kit/). Then:
#
#   run(command="bash load/gpu_session.sh 1", carry=[".whl", ".gpu-kit"], timeout_s=580)
#   run(command="bash load/gpu_session.sh 2", carry=[".whl", ".gpu-kit"], timeout_s=500)
#
# Stage 1 (at most 560 s): the environment, `portico bench gpu` on the sections issue 41's
# and 42's targets read (kernels, served, bandwidth, invariant, async), then every test marked
# `gpu`. Stage 2 (at most 470 s, in the order of what matters most if the session's device
# time runs out first): the decode attention kernel's bandwidth at issue 41's shapes, issue
# 43's fairness through a real `portico serve` on the card, then the other sections of the
# bench (greedy, offline, fp8). Each step has its own time limit, so one that hangs costs only
# its share; what a stage made comes back from $OUT, refreshed after every step:
# summary.txt (one line a step: its exit status, seconds and command), the benchmarks' JSON
# and logs-<stage>.tgz (every step's log, the plots, the tests' JUnit XML).
#
# DEVICE=cpu runs the same steps on a machine without CUDA (a check of this script: the
# steps that need CUDA say so and end; the fairness bench runs its --quick sizes). WHEELS=DIR
# takes the wheels from DIR instead of .whl/ (an empty one: the environment as it is).
set -uo pipefail
stage="${1:-1}"
device="${DEVICE:-cuda}"
out="${OUT:-/tmp/portico-gpu-out}"
logs="$(mktemp -d /tmp/portico-gpu-logs.XXXX)"
mkdir -p "$out"
cd "$(dirname "$0")/.."

site=/tmp/portico-site
wheels="${WHEELS:-.whl}"  # where the kit's wheels are (none: use the environment as it is)
if ls "$wheels"/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target "$site" "$wheels"/*.whl >"$logs/pip.log" 2>&1 || {
    echo "wheel install failed: $(tail -n 3 "$logs/pip.log")" | tee -a "$out/summary.txt"
    exit 3
  }
  export PYTHONPATH="$site:$PWD"
else
  export PYTHONPATH="$PWD"
fi
export PYTHONUNBUFFERED=1
pack() { tar -czf "$out/logs-$stage.tgz" -C "$logs" . 2>/dev/null; }
trap 'pack; rm -rf "$logs"' EXIT

# step NAME SECONDS COMMAND...: run it under its limit, log to $logs/NAME.log, one summary line
step() {
  local name=$1 limit=$2 t0=$SECONDS rc
  shift 2
  timeout -k 15 "$limit" "$@" >"$logs/$name.log" 2>&1
  rc=$?
  local cmd="$*"
  cmd="${cmd//$'\n'/ }"
  printf '%-16s rc=%-3s %4ss  %.110s\n' "$name" "$rc" "$((SECONDS - t0))" "$cmd" | tee -a "$out/summary.txt"
  tail -n 4 "$logs/$name.log"
  pack  # a call killed at its limit still brings back what the steps before wrote
}

model=.gpu-kit/smollm2-135m  # the default model's tokenizer and config, no weights
gpu_tests="tests/engine/test_async_inputs.py tests/engine/test_async_scheduling.py
  tests/engine/test_batch_invariant_triton.py tests/engine/test_cuda_graphs.py
  tests/engine/test_cuda_path.py tests/engine/test_fp8_linear.py
  tests/engine/test_sampler_batched.py tests/engine/test_triton_decode_attention.py"

step env 60 python3 -c "
import platform, torch
print('python', platform.python_version(), 'torch', torch.__version__, 'cuda', torch.version.cuda)
if torch.cuda.is_available():
    p = torch.cuda.get_device_properties(0)
    print(p.name, p.total_memory >> 30, 'GiB', p.multi_processor_count, 'SMs')
else:
    print('no CUDA device')
import engine.server.app, gateway.app, load.gpu_bench  # what the steps below import
print('imports: ok')"
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv \
  >>"$logs/env.log" 2>&1

case "$stage" in
1)
  step bench-gpu-1 290 python3 -m portico.cli bench gpu --budget-s 240 \
    --sections kernels served bandwidth invariant async --out "$out/gpu-1.json" \
    --plot "$logs/gpu-1.png"
  # -v: a line per test as it ends, so a step stopped at its limit still says which passed
  step gpu-tests 210 python3 -m pytest -v -m gpu -p no:cacheprovider --timeout 120 \
    --junitxml="$logs/gpu-tests.xml" $gpu_tests
  ;;
2)
  step decode-attn 60 python3 -m load.decode_attention_bench --output "$out/decode_attention.json"
  step fairness-gw 200 python3 -m load.fairness_gateway_bench --model "$model" \
    --engine-args "--device $device --load-format dummy --dtype bfloat16 --max-num-seqs 16" \
    --quiet-requests 8 --out "$out/fairness_gateway.json" --plot "$logs/fairness" --no-progress \
    $([ "$device" = cpu ] && echo --quick)
  step bench-gpu-2 150 python3 -m portico.cli bench gpu --budget-s 120 \
    --sections greedy offline fp8 --out "$out/gpu-2.json" --plot "$logs/gpu-2.png"
  ;;
*)
  echo "stage must be 1 or 2, got '$stage'" >&2
  exit 2
  ;;
esac
