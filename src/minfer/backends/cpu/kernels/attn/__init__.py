"""Attention over the KV cache, and the cache's memory formats.

    attend         the entry: per-token (decode, batch-invariant) and blocked (prefill) paths,
                   causal / windowed, grouped-query heads, soft-capped scores; the KV store
    vector_ir      the per-token kernel's scores and value mix as LLVM vector IR
    blocked        many query rows at once through BLAS sgemm (prefill)
    kv_formats     a cache row's layout (f32, f16, q8_0, q4_0), writing and reading it back
    rope_store     rope of q and k and the KV store as one step (k roped straight into the cache)
    quantized_kv   attention over q8_0 / q4_0 caches
"""
