"""`minfer quantize`: GGUF quantization byte-identical to llama.cpp's `llama_model_quantize`.

- `blocks32`, `kquants`: ggml's reference quantizers ported to numba, one row at a time.
- `weighted`: ggml's importance-weighted quantizers (`--imatrix`).
- `lattice`, `iqrows`, `iq1rows`: ggml's lattice i-quant quantizers (IQ1_S, IQ2_XXS/XS/S,
  IQ3_XXS/S).
- `rows`: `quantize_rows`, the parallel entry point per type (weighted given an imatrix).
- `mix`: llama.cpp's file types and per-tensor type rules (Q4_K_M, …, --pure, --tensor-type
  and the other overrides, the imatrix rules).
- `imatrix_file`: importance-matrix files (llama-imatrix's GGUF, and its legacy .dat read).
- `gguf_out`: the output header, as llama.cpp lays it out.
- `driver`: `quantize_model`, streaming tensor by tensor.
"""

from .driver import QuantizeReport, quantize_model
from .mix import FType, MixOptions, parse_ftype, parse_tensor_type
from .rows import QuantizeError, quantize_rows

__all__ = ["FType", "MixOptions", "QuantizeError", "QuantizeReport", "parse_ftype",
           "parse_tensor_type", "quantize_model", "quantize_rows"]
