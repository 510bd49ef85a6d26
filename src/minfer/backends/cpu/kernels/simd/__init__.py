"""Vector IR building blocks the kernels inline (numba intrinsics over LLVM vectors).

    llvm            intrinsics numba does not expose (f16 conversion, prefetch, BLAS calls)
                    and the CPU feature checks
    blocks          block dot products of the 32-value types (VNNI / AVX2 integer dots)
    kquants         row dot products of the K-quants (Q4_K, Q5_K, Q6_K)
    ternary         TQ1_0's row dot product on the file's base-3 bytes
    interleaved     16-row interleaved dots for Q4_0 / Q5_0 / Q8_0 (the repacked layout)
    interleaved_k   16-row interleaved dots for Q4_K / Q6_K
"""
