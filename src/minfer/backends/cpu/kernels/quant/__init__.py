"""GGUF block formats: what the types are, and every conversion between them.

    types         the tensor types the CPU kernels handle and their block layouts
    dequant       weight rows to f32 (bit-exact with gguf.quants), the embedding lookup
    iquants       the i-quants, TQ1_0 / TQ2_0 and MXFP4: their blocks as integers and values
    iq_grids      ggml's i-quant lattices, sign table and 4-bit level tables
    activations   activation quantization to Q8_0 / Q8_1 / Q8_K
    repack        the 16-row interleaved weight layouts, made once per weight
    reencode      exact re-encodings into wider types that have fast kernels (Q3_K, the
                  i-quants below 4 bits, TQ2_0; IQ4_NL / IQ4_XS / MXFP4 / TQ1_0 run in their
                  own blocks)
"""
