"""Small kernel runs for compute-sanitizer (memcheck, racecheck, synccheck): every kernel family,
awkward shapes.

    compute-sanitizer --tool memcheck python bench/sanitize_cases.py
    python bench/sanitize_cases.py --dry-run      # the same calls, smaller, on the emulator (no GPU)

CuPy's memory pool is switched off so every array is its own cudaMalloc: memcheck then sees a
read or write past an array's end instead of landing silently in a neighbour's pool block.
"""
import argparse
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import cupy_attn  # noqa: E402
from cupy_attn import _kernel_backend  # noqa: E402

CASES = ((40, 37, 70, dict(causal=True)),
         (128, 65, 33, dict(window=(8, 2), kv_lengths=[33, 20])),
         (256, 17, 50, dict(mask=np.random.default_rng(1).random((17, 50)) < 0.8, softcap=5.0)),
         # the wide tiles, dropout and a mask_mod (appended code, mod_words)
         (576, 19, 41, dict(causal=True, dropout_p=0.3, dropout_seed=3, mask_mod=cupy_attn.MaskMod(
             "(q_idx + kv_idx) % period != 1", lambda b, h, q_idx, kv_idx, period: (q_idx + kv_idx) % period != 1,
             scalars={"period": 3}))))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dry-run", action="store_true", help="run the calls on the emulator, first case only")
    args = parser.parse_args(argv)
    if args.dry_run:
        xp, backend, cases = np, "emulator", CASES[:1]
    else:
        import cupy

        cupy.cuda.set_allocator(None)
        xp, backend, cases = cupy, "auto", CASES
    rng = np.random.default_rng(0)
    runs = 0
    # The GPU's default kernels, then on compute capability 9.0 the wgmma ones; the persistent wgmma
    # forward on 2 blocks, so that these few work tiles (8 a call) are claimed past the blocks' own.
    hopper = xp is not np and int(xp.cuda.Device().compute_capability) == 90
    _kernel_backend.resident_blocks = lambda target: 2
    for capability in (None, 90) if hopper else (None,):
        _kernel_backend.CUDA_COMPUTE_CAPABILITY = capability
        for dtype in (np.float16, np.float32):
            for d, sq, sk, kw in cases:
                q = xp.asarray(rng.standard_normal((2, 4, sq, d)).astype(dtype))
                k, v = (xp.asarray(rng.standard_normal((2, 2, sk, d)).astype(dtype)) for _ in range(2))
                gkw = {n: xp.asarray(x) if isinstance(x, (np.ndarray, list)) else x for n, x in kw.items()}
                out, lse = cupy_attn.attention(q, k, v, return_lse=True, backend=backend, **gkw)
                for deterministic in (False, True):
                    cupy_attn.attention_backward(xp.ones_like(out), q, k, v, out, lse, deterministic=deterministic,
                                                 backend=backend, **gkw)
                runs += 1
    if xp is not np:
        xp.cuda.Device().synchronize()
    print(f"sanitize cases ran: {runs}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
