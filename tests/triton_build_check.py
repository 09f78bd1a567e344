"""Run by `tests/test_triton_kernels.py` in a process of its own, so that Triton is imported without its interpreter:
`python triton_build_check.py CAPABILITY...` (e.g. 80 90 100).

Builds each hand-written kernel of `alignpipe.triton_kernels` for NVIDIA GPUs of each compute capability, down to the
cubin that ptxas writes. It takes the arguments that the launch functions pass at Qwen2-0.5B's sizes, in bf16 and
float32, and specialises them as Triton specialises a launch on such a GPU: Triton's own binder and argument packing,
given that target instead of a device's. No GPU is needed. Each build prints one JSON line with:
- the kernel, its variant and the capability;
- from cuobjdump's resource usage: the registers a thread takes, and the bytes of local memory (registers spilled)
  and of shared memory;
- the global loads and stores of its PTX, counted by width.
The builds land in Triton's cache as a training process's builds do (`triton_kernels.share_compile_cache`).

On a CPU the tests run these kernels in Triton's interpreter, which checks what they compute but not that they compile,
and ignores the compiler hints (`tl.multiple_of`, `tl.max_contiguous`) on which their vector loads depend."""

import collections
import json
import re
import subprocess
import sys
import tempfile
import types
from pathlib import Path

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource, make_backend
from triton.runtime.jit import create_function_from_signature

from alignpipe import triton_jit, triton_kernels

HIDDEN, INTERMEDIATE, HEADS, KV_HEADS, HEAD_DIM, VOCAB = 896, 4864, 14, 2, 64, 151936  # Qwen2-0.5B
launches: list[tuple[str, str, tuple, dict]] = []
variant = [""]  # what the launches recorded next are a variant of: their dtype, direction or slices


class _Recorded:
    """Stands for a kernel: `kernel[grid](*args, **kwargs)` records the launch under the current variant's name."""

    def __init__(self, name: str):
        self.name = name

    def __getitem__(self, grid):
        return lambda *args, **kwargs: launches.append((self.name, variant[0], args, kwargs))


triton_kernels._kernels()  # what a first launch does before its build: Triton's cache is chosen there
triton_kernels._kernels = lambda: types.SimpleNamespace(  # type: ignore[assignment]
    **{name: _Recorded(name) for name, fn in vars(triton_jit).items() if isinstance(fn, triton.JITFunction)}
)

for dtype in (torch.bfloat16, torch.float32):
    kind = str(dtype).removeprefix("torch.")
    variant[0] = kind
    merged = torch.zeros(8, 2 * INTERMEDIATE, dtype=dtype)  # a merged gate/up projection's output: strided halves
    gate, up = merged[:, :INTERMEDIATE], merged[:, INTERMEDIATE:]
    triton_kernels.silu_mul(gate, up)
    triton_kernels.silu_mul_grads(torch.zeros(8, INTERMEDIATE, dtype=dtype), gate, up)
    variant[0] = f"{kind}, product kept"
    triton_kernels.silu_mul_grads(torch.zeros(8, INTERMEDIATE, dtype=dtype), gate, up, product=True)
    q = torch.zeros(2, 16, HEADS, HEAD_DIM, dtype=dtype).transpose(1, 2)  # (B, heads, T, D) views of projections
    k = torch.zeros(2, 16, KV_HEADS, HEAD_DIM, dtype=dtype).transpose(1, 2)
    cos, sin = torch.zeros(1, 16, HEAD_DIM, dtype=dtype), torch.zeros(1, 16, HEAD_DIM, dtype=dtype)
    for backward in (False, True):
        variant[0] = f"{kind}, {'backward' if backward else 'forward'}"
        triton_kernels.rotary(q, k, cos, sin, backward=backward)
    variant[0] = kind
    logits, labels = torch.zeros(4, VOCAB, dtype=dtype), torch.zeros(4, dtype=torch.int64)
    lse, _ = triton_kernels.token_scores(logits, labels, 0.7)
    triton_kernels.token_grads(logits, lse, labels, torch.ones(4), 0.7)
    variant[0] = f"{kind}, with the entropy"
    _, _, spread = triton_kernels.token_scores(logits, labels, 0.7, "entropy")
    triton_kernels.token_grads(logits, lse, labels, torch.ones(4), 0.7, (spread, torch.ones(4)))
    variant[0] = f"{kind}, with log Σp²"
    triton_kernels.token_scores(logits, labels, 0.7, "log_sum_sq")
    variant[0] = kind
    triton_kernels.token_kl(logits, torch.zeros(4, VOCAB, dtype=dtype), labels, 0.7)

scalars = (0.9, 0.999, 1e-3, 0.5, 1e-5, 1e-8)
for variant[0], sizes in (("aligned slices", (HIDDEN * 64, INTERMEDIATE)), ("a slice of 17 values", (HIDDEN, 17))):
    pieces = [tuple(torch.zeros(n, dtype=torch.bfloat16) for _ in range(5)) for n in sizes]
    triton_kernels.kahan_adamw(pieces, scalars, triton_kernels.AdamWBlocks())

cuobjdump = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"


def build(name: str, args: tuple, kwargs: dict, capability: int):
    """`triton.compile` of one launch for a GPU of `capability`, specialised as `JITFunction.run` specialises it."""
    fn = getattr(triton_jit, name)
    target = GPUTarget("cuda", capability, 32)
    backend = make_backend(target)
    binder = create_function_from_signature(fn.signature, fn.params, backend)
    kwargs = {"debug": False, "instrumentation_mode": triton.knobs.compilation.instrumentation_mode, **kwargs}
    bound, specialization, options = binder(*args, **kwargs)
    options, signature, constexprs, attrs = fn._pack_args(backend, kwargs, bound, specialization, options)
    return triton.compile(ASTSource(fn, signature, constexprs, attrs), target=target, options=options.__dict__)


for capability in map(int, sys.argv[1:]):
    for name, label, args, kwargs in launches:
        kernel = build(name, args, kwargs, capability)
        with tempfile.NamedTemporaryFile(suffix=".cubin") as cubin:
            cubin.write(kernel.asm["cubin"])
            cubin.flush()
            usage = subprocess.run([str(cuobjdump), "-res-usage", cubin.name], capture_output=True, text=True).stdout
        found = dict(re.findall(r"\b(REG|LOCAL|SHARED):(\d+)", usage))
        memory = collections.Counter(re.findall(r"\b((?:ld|st)\.global[\w.]*)", kernel.asm["ptx"]))
        line = {"kernel": name, "variant": label, "capability": capability, "registers": int(found["REG"])}
        line |= {"local": int(found["LOCAL"]), "shared": int(found["SHARED"]), "memory": dict(memory)}
        print(json.dumps(line), flush=True)
