"""Small kernel runs for compute-sanitizer (memcheck, racecheck): every kernel, awkward shapes.

    compute-sanitizer --tool memcheck python bench/sanitize_cases.py
"""
import sys
from pathlib import Path

import cupy
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import cupy_attn  # noqa: E402

from cupy_attn import _kernel_backend  # noqa: E402

rng = np.random.default_rng(0)
# The GPU's own kernels, then those chosen for compute capability 8.0 (on an sm_90 GPU: the
# mma.sync kernels instead of the wgmma ones).
for capability in (None, 80):
    _kernel_backend.CUDA_COMPUTE_CAPABILITY = capability
    for dtype in (np.float16, np.float32):
        for d, sq, sk, kw in ((40, 37, 70, dict(causal=True)), (128, 65, 33, dict(window=(8, 2), kv_lengths=[33, 20])),
                              (256, 17, 50, dict(mask=rng.random((17, 50)) < 0.8, softcap=5.0))):
            q = cupy.asarray(rng.standard_normal((2, 4, sq, d)).astype(dtype))
            k, v = (cupy.asarray(rng.standard_normal((2, 2, sk, d)).astype(dtype)) for _ in range(2))
            gkw = {n: cupy.asarray(x) if isinstance(x, (np.ndarray, list)) else x for n, x in kw.items()}
            out, lse = cupy_attn.attention(q, k, v, return_lse=True, **gkw)
            for deterministic in (False, True):
                cupy_attn.attention_backward(cupy.ones_like(out), q, k, v, out, lse, deterministic=deterministic, **gkw)
cupy.cuda.Device().synchronize()
print("sanitize cases ran")
