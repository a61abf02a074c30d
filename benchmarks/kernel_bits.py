"""Which CPU kernels give the same bits at any thread count, and what they cost: why --bitwise pins one thread.

    python benchmarks/kernel_bits.py        # ~2 min on 2 cores

For each setting, a fresh process per thread count (MKL reads MKL_CBWR before its first call) trains one
micro-batch of 100 — forward, backward, a fused SGD step — from the same weights and inputs, and the gradients,
the loss and BatchNorm's buffers at 2, 3 and 4 threads are compared bit for bit with 1 thread's (the largest
relative difference is printed); then the step is timed at 1 and 2 threads (best of 5 rounds of 20 steps).
Prints; asserts nothing.
"""

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

SETTINGS = {  # name: (channels_last, bf16 autocast, oneDNN on, MKL_CBWR)
    "default: oneDNN, channels_last, bf16": (True, True, True, None),
    "oneDNN, channels_last, fp32": (True, False, True, None),
    "oneDNN, NCHW, fp32": (False, False, True, None),
    "oneDNN, NCHW, fp32, MKL strict": (False, False, True, "AVX512,STRICT"),
    "native conv, NCHW, fp32, MKL strict": (False, False, False, "AVX512,STRICT"),
    "native conv, channels_last, fp32, MKL strict": (True, False, False, "AVX512,STRICT"),
}

CHILD = r"""
import json, sys, time, torch, torch.nn.functional as F
from mnist_ddp.model import ConvNet
threads, out = int(sys.argv[1]), sys.argv[5]
cl, bf16, onednn, timed = (sys.argv[i] == "1" for i in (2, 3, 4, 6))
torch.set_num_threads(threads)
torch.backends.mkldnn.enabled = onednn
torch.manual_seed(0)
model, g = ConvNet(), torch.Generator().manual_seed(1)
x, y = torch.randn(100, 1, 28, 28, generator=g), torch.randint(0, 10, (100,), generator=g)
if cl:
    model, x = model.to(memory_format=torch.channels_last), x.contiguous(memory_format=torch.channels_last)
opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9, fused=True)
def step():
    opt.zero_grad(set_to_none=True)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
        loss = F.cross_entropy(model(x), y, reduction="sum")
    loss.backward()
    return loss
loss = step()
state = {"loss": loss.detach().float()} | {n: p.grad for n, p in model.named_parameters()} | dict(model.named_buffers())
torch.save(state, out)
best = None
if timed:
    for _ in range(5):
        step(); opt.step()
    for _ in range(5):
        start = time.perf_counter()
        for _ in range(20):
            step(); opt.step()
        best = min(best or 1e9, (time.perf_counter() - start) / 20)
print(json.dumps(best))
"""


def _child(threads: int, setting: tuple, out: Path, timed: bool) -> float | None:
    cl, bf16, onednn, cbwr = setting
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "MKL_CBWR")}
    if cbwr:
        env["MKL_CBWR"] = cbwr
    r = subprocess.run([sys.executable, "-c", CHILD, str(threads), *("1" if f else "0" for f in (cl, bf16, onednn)),
                        str(out), "1" if timed else "0"], env=env, capture_output=True, text=True, check=True)
    return json.loads(r.stdout.splitlines()[-1])


def _difference(a: dict, b: dict) -> str:
    """'same bits', or how far apart: the largest relative L2 difference of a tensor that differs."""
    import torch

    differ = [k for k in a if not torch.equal(a[k], b[k])]
    # A convolution's bias gradient before BatchNorm is ~0 (BatchNorm removes the mean): its relative
    # difference is noise, so it is left out of the largest (not out of the verdict).
    sized = [float((a[k].double() - b[k].double()).norm() / max(float(a[k].double().norm()), 1e-30))
             for k in differ if not k.endswith("0.bias")]
    return "same bits" if not differ else f"{max(sized, default=float('nan')):.1e}"


def main() -> None:
    import torch

    print(f"torch {torch.__version__}; relative difference from 1 thread at 2, 3, 4 threads; ms per step")
    with tempfile.TemporaryDirectory() as tmp:
        for name, setting in SETTINGS.items():
            times, states = {}, {}
            for threads in (1, 2, 3, 4):
                out = Path(tmp) / f"{threads}.pt"
                times[threads] = _child(threads, setting, out, timed=threads <= 2)
                states[threads] = torch.load(out, weights_only=True)
            diffs = ", ".join(_difference(states[1], states[t]) for t in (2, 3, 4))
            one, two = times[1], times[2]
            assert one is not None and two is not None  # timed: 1 and 2 threads (a child not timed says null)
            print(f"  {name:46s} {diffs:34s} 1 thread {1e3 * one:6.1f} ms, 2 threads {1e3 * two:6.1f} ms")


if __name__ == "__main__":
    main()
