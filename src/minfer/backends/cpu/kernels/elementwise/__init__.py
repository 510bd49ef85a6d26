"""Row-wise and element-wise ops.

    norm    RMSNorm over rows and over each head (Qwen3's q/k norm)
    norm_quant  an RMSNorm (after a residual add or not) and its rows' Q8 quantization, one step
    rope    rotary position embedding (normal and NEOX styles)
    arith   silu, swiglu, add, mul, softmax helpers
    gelu    Gemma's GELU, GeGLU, scale and soft-cap
"""
