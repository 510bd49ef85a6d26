"""GGUF block formats: what the types are, and every conversion between them.

    types         the tensor types the CPU kernels handle and their block layouts
    dequant       weight rows to f32 (bit-exact with gguf.quants), the embedding lookup
    activations   activation quantization to Q8_0 / Q8_1 / Q8_K
    repack        the 16-row interleaved weight layouts, made once per weight
    reencode      exact re-encodings into wider types that have fast kernels (IQ4_NL, Q3_K)
"""
