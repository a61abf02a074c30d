"""Per-device compute settings: how local processes share the cores, and the fastest precision and layout.

`--amp auto` and an unset `--channels-last` are decided here, once the process knows
its device. The choices follow measurements of this ConvNet (benchmarks/ab_compute.py):
- CPU: channels_last always, and bf16 autocast where the CPU computes bf16 in hardware
  (AMX or AVX512-BF16). Together they train ~2.4× faster than fp32 NCHW on a 2-core Xeon
  with AMX; either one alone gives only 1.0–1.5×. Where bf16 would be emulated it is
  slower than fp32, so fp32 stays.
- CUDA: fp32 storage with TF32 tensor-core math and cuDNN autotuning. At this size every
  step is bound by kernel launches, not arithmetic, and autocast only adds cast kernels;
  `--amp bf16` is there to try (benchmarks/gpu_check.py compares both; not yet run on a GPU).
- MPS: plain fp32, the layout and precision its kernels support best.
An explicit flag always wins over these defaults.
"""

import contextlib
import os
from collections.abc import Mapping

import torch

from .errors import UserError


def cpu_has_fast_bf16() -> bool:
    """Whether this CPU does bf16 arithmetic in hardware (AMX tiles or AVX512-BF16).

    torch exposes the check only as private helpers; a torch without them reports False,
    which is the safe answer (fp32).
    """
    checks = ("_is_amx_tile_supported", "_is_avx512_bf16_supported")
    return any(getattr(torch.cpu, name, lambda: False)() for name in checks)


def amp_for(amp: str, device: torch.device) -> str:
    """`--amp` with `auto` decided for `device`: bf16 where the CPU computes it in hardware, else off."""
    if amp != "auto":
        return amp
    return "bf16" if device.type == "cpu" and cpu_has_fast_bf16() else "off"


def channels_last_for(channels_last: bool | None, device: torch.device) -> bool:
    """`--[no-]channels-last`, or when not given, on for CPUs (faster there) and off elsewhere."""
    return device.type == "cpu" if channels_last is None else channels_last


def autocast(device: torch.device, amp: str, cache: bool = True) -> contextlib.AbstractContextManager:
    """Mixed precision for the forward pass, or nothing when `amp` is off; `cache=False` inside a CUDA graph."""
    if amp == "off":
        return contextlib.nullcontext()
    return torch.autocast(device.type, dtype=torch.bfloat16 if amp == "bf16" else torch.float16, cache_enabled=cache)


# The cuBLAS workspace sizes with which its GEMMs are deterministic; torch refuses any other under
# use_deterministic_algorithms. torch reads the variable itself, with getenv, when it first needs it: for that
# check, and for the workspace it hands cuBLAS (aten/src/ATen/cuda/CublasHandlePool.cpp, parseChosenWorkspaceSize,
# its result kept for the process; hence "a new subprocess" per setting in torch/testing/_internal/common_utils.py).
DETERMINISTIC_CUBLAS = (":4096:8", ":16:8")


def cublas_workspace(deterministic: bool, device_type: str, env: Mapping[str, str]) -> dict[str, str]:
    """What --deterministic on CUDA needs set: CUBLAS_WORKSPACE_CONFIG=:4096:8 where it is unset (else the
    first cuBLAS call, the model's `fc`, raises). A value of the user's that cuBLAS is not deterministic
    with is refused, in one sentence."""
    if not deterministic or device_type != "cuda":
        return {}
    value = env.get("CUBLAS_WORKSPACE_CONFIG")
    if value is None:
        return {"CUBLAS_WORKSPACE_CONFIG": DETERMINISTIC_CUBLAS[0]}
    if value not in DETERMINISTIC_CUBLAS:
        raise UserError(f"--deterministic on CUDA needs CUBLAS_WORKSPACE_CONFIG={' or '.join(DETERMINISTIC_CUBLAS)}, "
                        f"but it is set to {value!r}; change it or unset it (mnist-ddp then sets :4096:8).")
    return {}


def configure_backends(device: torch.device, deterministic: bool, bitwise: bool = False) -> str:
    """Process-wide kernel settings for `device`; `deterministic` forbids the autotuned ones. Returns what it set
    in the environment, for the log ('' when nothing).

    `bitwise` (the same bits at any world size) needs kernels that compute a micro-batch the same way every
    time: on a GPU the deterministic ones (no atomics, no autotuning: cuDNN's choice by timing differs from run
    to run); on a CPU one thread per process does it (`share_cores`), whatever the kernels.

    Called in every rank before it joins the process group and before any kernel runs: the environment must be
    the rank's own (forked children have the fork server's, not the launcher's), cuBLAS reads it at its first
    call, and ProcessGroupNCCL reads `use_deterministic_algorithms` when it is made (it then turns off NVLS
    reductions, which are not deterministic)."""
    deterministic = deterministic or (bitwise and device.type != "cpu")
    settings = cublas_workspace(deterministic, device.type, os.environ)
    os.environ.update(settings)
    if deterministic:
        torch.use_deterministic_algorithms(True)
        torch.backends.cudnn.benchmark = False
    elif device.type == "cuda":
        torch.backends.cudnn.benchmark = True  # the batch shape is fixed: tune each convolution once
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True  # fp32 tensors, TF32 tensor-core math (~1e-3 rel. error)
        torch.backends.cudnn.allow_tf32 = True
    return " ".join(f"{k}={v}" for k, v in settings.items())


def fused_optimizers(device: torch.device) -> bool:
    """Fused SGD/AdamW (one kernel per step) exist for CUDA, and for the CPU since torch 2.4."""
    return device.type == "cuda" or (device.type == "cpu" and torch.__version__ >= "2.4")


def share_cores(local_rank: int, local_world_size: int, threads: int | None = None) -> None:
    """Give this CPU process its own slice of the cores: as many threads as cores in it (or `threads`), pinned
    there.

    Without it every local process would start one thread per core of the machine and they would
    all fight over them. Pinning keeps a rank's threads (and gloo's, started later, which inherit
    the pinning) off its neighbours' cores: measured with -g 2 on 2 cores, the ranks wait ~40% less
    for each other at each all-reduce, ~7% faster steps. An explicit OMP_NUM_THREADS keeps its
    thread count (torchrun sets 1 when it starts several processes per node); `threads` overrides both
    (--bitwise: 1, because the CPU kernels' sums, and so their last bits, depend on the thread count).
    """
    has_affinity = hasattr(os, "sched_getaffinity")  # Linux; elsewhere only the thread count is shared
    allowed = sorted(os.sched_getaffinity(0)) if has_affinity else list(range(os.cpu_count() or 1))
    n = len(allowed)
    mine = allowed[local_rank * n // local_world_size:(local_rank + 1) * n // local_world_size]
    if has_affinity and 1 < local_world_size <= n:
        os.sched_setaffinity(0, mine)
    if threads:
        torch.set_num_threads(threads)
    elif not os.environ.get("OMP_NUM_THREADS"):
        torch.set_num_threads(max(1, len(mine)))


def sync(device: torch.device) -> None:
    """Wait for queued GPU work, so that wall-clock timings mean something."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
