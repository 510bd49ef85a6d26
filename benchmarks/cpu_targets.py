"""Emulated CPU targets for the benchmarks: the environment that makes minfer (numba, numpy's
OpenBLAS) and torch (ATen, oneDNN, MKL) compile and pick kernels as on an older CPU, so an
AVX-512 / AMX host can measure both engines as on an AVX2-only or an AVX-512 VNNI one.

- `avx2`: Haswell (AVX2/FMA/F16C; no AVX-512, no VNNI, no AMX).
- `avx512-vnni`: Ice Lake server (AVX-512 with VNNI; no AMX, no AVX-512 BF16/FP16, no AVX-VNNI).

numba needs NUMBA_CPU_FEATURES as well as NUMBA_CPU_NAME: with the name alone it keeps the
host's feature list (AVX-512 code on an AVX-512 host). As in .ci/run.
"""

from __future__ import annotations

HASWELL_FEATURES = ("+64bit,+avx,+avx2,+bmi,+bmi2,+cmov,+crc32,+cx16,+cx8,+f16c,+fma,+fsgsbase,"
                    "+fxsr,+invpcid,+lzcnt,+mmx,+movbe,+pclmul,+popcnt,+rdrnd,+sahf,+sse,+sse2,"
                    "+sse3,+sse4.1,+sse4.2,+ssse3,+xsave,+xsaveopt")
ICELAKE_FEATURES = (HASWELL_FEATURES + ",+adx,+aes,+avx512bitalg,+avx512bw,+avx512cd,+avx512dq,"
                    "+avx512f,+avx512ifma,+avx512vbmi,+avx512vbmi2,+avx512vl,+avx512vnni,"
                    "+avx512vpopcntdq,+clflushopt,+clwb,+gfni,+prfchw,+rdpid,+rdseed,+sha,+vaes,"
                    "+vpclmulqdq,+xsavec,+xsaves")

# minfer's side: numba's target, and numpy's OpenBLAS (the sgemm prefill path picks its
# kernels from the CPU it runs on unless told)
TARGET_ENV: dict[str, dict[str, str]] = {
    "native": {},
    "avx2": {"NUMBA_CPU_NAME": "haswell", "NUMBA_CPU_FEATURES": HASWELL_FEATURES,
             "OPENBLAS_CORETYPE": "Haswell"},
    "avx512-vnni": {"NUMBA_CPU_NAME": "icelake-server", "NUMBA_CPU_FEATURES": ICELAKE_FEATURES,
                    "OPENBLAS_CORETYPE": "SkylakeX"},
}

# torch's side: ATen's vectorised kernels, oneDNN's ISA cap (its GEMMs and convolutions) and
# MKL's (sgemm)
TORCH_ENV: dict[str, dict[str, str]] = {
    "native": {},
    "avx2": {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2",
             "MKL_ENABLE_INSTRUCTIONS": "AVX2"},
    "avx512-vnni": {"ATEN_CPU_CAPABILITY": "avx512", "ONEDNN_MAX_CPU_ISA": "AVX512_CORE_VNNI",
                    "MKL_ENABLE_INSTRUCTIONS": "AVX512_E1"},
}
