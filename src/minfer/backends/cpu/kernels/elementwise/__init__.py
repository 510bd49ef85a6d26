"""Row-wise and element-wise ops.

    norm    RMSNorm over rows and over each head (Qwen3's q/k norm)
    rope    rotary position embedding (normal and NEOX styles)
    arith   silu, swiglu, add, mul, softmax helpers
    gelu    Gemma's GELU, GeGLU, scale and soft-cap
"""
