#!/usr/bin/env bash
# One-shot GPU check, under 6 minutes: the bench on CUDA (images/s and the ratios against the tutorial),
# then the compute settings side by side, a per-phase profile of a step, and what --bitwise shows on one GPU.
#
#   bash benchmarks/gpu_check.sh            # on a machine with an NVIDIA GPU and a CUDA build of torch
#   DEVICE=cpu QUICK=1 bash benchmarks/gpu_check.sh   # the same script as a smoke run anywhere
#
# It installs nothing but this project, and that without dependencies (the torch and tqdm already there
# are used, nothing is downloaded); if even that is not possible it runs the project from src/.
# Outputs go to ${OUT:-runs/gpu-check}; the bench's JSON is ${OUT}/bench/bench.json.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
DEVICE=${DEVICE:-cuda}
OUT=${OUT:-runs/gpu-check}
export PYTHONUNBUFFERED=1

"$PY" - "$DEVICE" <<'EOF'
import sys
import torch, tqdm  # noqa: F401  (both must already be there: nothing is installed from the network)
if sys.argv[1] == "cuda" and not torch.cuda.is_available():
    sys.exit(f"gpu_check: torch {torch.__version__} sees no CUDA GPU here.")
print(f"gpu_check: torch {torch.__version__}, cuda {torch.version.cuda}, "
      f"{torch.cuda.get_device_name(0) if torch.cuda.is_available() else 'no GPU'}")
EOF
if ! "$PY" -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1; then
    echo "gpu_check: could not pip install the project; running it from src/"
    export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"
fi
mkdir -p "$OUT"
if [ -e "$OUT/bench" ]; then echo "gpu_check: $OUT/bench exists; set OUT to a new folder." >&2; exit 2; fi

quick=()
[ -n "${QUICK:-}" ] && quick=(--quick)
echo "== bench: tutorial vs ours on $DEVICE (the tutorial gets at most 60 s to reach the target)"
timeout 170 "$PY" -m mnist_ddp bench --device "$DEVICE" --tutorial-seconds 60 --out "$OUT/bench" "${quick[@]}" \
    || echo "(bench stopped: $?)"

echo "== compute settings, one process (fp32/bf16 x NCHW/channels_last, and torch.compile)"
steps=(--steps 60 --rounds 5)
[ -n "${QUICK:-}" ] && steps=(--steps 5 --rounds 1)
timeout 80 "$PY" benchmarks/ab_compute.py --device "$DEVICE" --compile "${steps[@]}" || echo "(A/B stopped: $?)"

echo "== where a step's time goes (default settings)"
prof=(--steps 300)
[ -n "${QUICK:-}" ] && prof=(--steps 20 --warmup 5)
timeout 40 "$PY" benchmarks/profile_epoch.py --device "$DEVICE" --procs 1 "${prof[@]}" || echo "(profile stopped: $?)"

echo "== --bitwise on one GPU: the same run twice saves the same bytes; 2 micro-batches of 2B are another run"
timeout 120 "$PY" benchmarks/bitwise_check.py --device "$DEVICE" || echo "(bitwise check stopped: $?)"
