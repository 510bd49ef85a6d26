"""`out = x @ W.T`: the projections (matmuls) for every weight type.

    dispatch      the public entry: decode vs prefill path, binding, activation quantization
    row_drivers   the row-parallel matrix-vector drivers, generated per type from templates
    gate_up       gate, up, SwiGLU and down's activation quantize as one step (decode FFN)
    dots32        integer dots of the 32-value block types (Q4_0 … Q8_0)
    dots_k        integer dots of the K-quants (Q2_K .. Q6_K, IQ4_XS, TQ2_0)
    dots_tq1      TQ1_0's per-call activation form (its dot: `simd.ternary`)
    float_rows    F32 / F16 / BF16 weights at small token counts
    sgemm         prefill: dequantized weight tiles through BLAS sgemm
"""
