"""Per-device compute settings: how local processes share the cores, kernel settings, and the default precision
and layout (CPU: channels_last, bf16 where in hardware; CUDA: fp32 with TF32; MPS: fp32). An explicit flag always
wins; the measurements behind the defaults are in docs/design/compute.md."""

import contextlib
import os
from collections.abc import Mapping

import torch

from ..common.errors import UserError


def cpu_has_fast_bf16() -> bool:
    """Whether this CPU does bf16 arithmetic in hardware (AMX tiles or AVX512-BF16); False (fp32, the safe
    answer) where torch lacks the private helpers that tell."""
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
# use_deterministic_algorithms, and reads the variable once per process (docs/design/compute.md).
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
    """Process-wide kernel settings for `device`; `deterministic` (implied by `bitwise` off the CPU) forbids the
    autotuned ones. Call in every rank before it joins the process group and before any kernel runs
    (docs/design/compute.md). Returns what it set in the environment, for the log ('' when nothing)."""
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
    """Give this CPU process its own slice of the cores, pinned there (Linux), with as many threads as cores in
    it; an explicit OMP_NUM_THREADS keeps its count, and `threads` overrides both (--bitwise: 1). Why:
    docs/design/compute.md."""
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


def available_memory() -> int | None:
    """Bytes of memory free for new processes now (Linux's MemAvailable), None where /proc does not say."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None
