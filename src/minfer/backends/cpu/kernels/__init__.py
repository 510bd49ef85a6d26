"""minfer.backends.cpu.kernels: compiled (numba) CPU kernels; numpy in, numpy out.

Grouped by role, each package's docstring its map: `linear` (the projections: dispatch, the
per-type row drivers, sgemm prefill), `attn` (attention over the KV cache and the cache's
formats), `quant` (block types, dequantization, activation quantization, repacking),
`elementwise` (norms, RoPE, activations), `recurrent` (ops carrying a per-sequence state),
`simd` (the vector IR the others inline);
`reference` holds the slow numpy references the kernels are tested against.

Public API (see docs/interfaces.md):
- matmul(w_raw, qtype, x, out), quantize_activation(x, qtype), matmul_prequant(w, qtype, xq, out),
  quantize_q8_0(x), quantize_q8_k(x), packable(qtype, n_in, n_out), repack_weight(w_raw, qtype),
  bind_prequant(w_raw, qtype) -> run(xq, out) -- `linear.dispatch`
- bind_moe(x, logits, gate, up, down, ...): a mixture-of-experts FFN (routing, rows grouped by
  expert, the row drivers' expert forms) -- `linear.experts`
- gemm(x, dense_weight(w), out): the batch-invariant f32 GEMM over an f32 copy of a weight in
  column tiles (encoders) -- `linear.dense`
- bind_gemm_amx(x, amx_weight(w), out): the batch-invariant bf16 GEMM on AMX tiles (encoders
  whose file stores weights below f32, where `amx_usable()`) -- `linear.amx`
- bind_gemm_i16(x, i16_weight(*q8_0_codes(raw) or int8_codes(w)), out): the batch-invariant
  int16-activation x int8-weight GEMM (encoders with block-type weights, without AMX) --
  `linear.gemm_i16`
- dequantize(w_raw, qtype, n_in), get_rows(w_raw, qtype, ids, out) -- `quant.dequant`
- rms_norm, head_rms_norm, layer_norm, rope, rope_neox, silu, swiglu, add, mul, gelu, geglu,
  gelu_erf, tanh, scale, softcap, sigmoid_gate, sigmoid_mul, softmax_rows, round_f16,
  bind_pool (mean / cls / last rows of each sequence) -- `elementwise`
- short_conv(bcx, taps, state, positions, seq, out), new_state(n_seq, l_cache, n_embd): LFM2's
  gated short convolution over each sequence's carried state; ssm_conv (Qwen3.5's, then
  SiLU) -- `recurrent.shortconv`
- delta_net(qkv, alpha, beta, dt_bias, a, state, positions, seq, out), new_delta_state(n_seq,
  n_v_heads, head_dim): Qwen3.5's gated delta rule over each sequence's state matrices --
  `recurrent.delta_net`
- sequence_attention (an encoder's: within each sequence of the batch, no cache) --
  `attn.sequences`
- attention (blocked=True: the sgemm kernel of `attn.blocked`, used from
  ATTN_BLOCKED_MIN_TOKENS rows when not batch invariant), kv_store -- `attn.attend`
- bind_*(same arguments) -> a no-argument call: the kernel over fixed arrays, checked once (the
  op tape); new_activation / bind_quantize / bind_prequant_into for a matmul's activation;
  bind_gate_up: gate, up, SwiGLU and down's activation quantize as one step -- `linear.gate_up`

The hot loops do not depend on numba's auto-vectoriser settings: the quantized dots are explicit
vector IR (`simd.blocks`, `simd.kquants`), and the element-wise loops are simple enough for
LLVM's loop vectoriser (kernels with divisions use error_model="numpy" so no zero-check blocks
it).
"""

from __future__ import annotations

# first: where the compiled kernels are cached, and how the workers wait (before any region)
import minfer.backends.cpu.waits
import minfer.jit_cache  # noqa: F401
from minfer.backends.cpu.kernels.attn.attend import attention, bind_attention, kv_store
from minfer.backends.cpu.kernels.attn.blocked import BLOCKED_MIN_TOKENS as ATTN_BLOCKED_MIN_TOKENS
from minfer.backends.cpu.kernels.attn.kv_formats import bind_store_kv
from minfer.backends.cpu.kernels.attn.rope_store import bind_rope_store
from minfer.backends.cpu.kernels.attn.sequences import (
    bind_sequence_attention,
    sequence_attention,
)
from minfer.backends.cpu.kernels.attn.sequences import (
    scratch_size as sequence_attention_scratch_size,
)
from minfer.backends.cpu.kernels.elementwise.arith import (
    add,
    bind_add,
    bind_mul,
    bind_silu,
    bind_swiglu,
    mul,
    round_f16,
    sigmoid_gate,
    sigmoid_mul,
    silu,
    softmax_rows,
    swiglu,
)
from minfer.backends.cpu.kernels.elementwise.gelu import (
    geglu,
    gelu,
    gelu_erf,
    scale,
    softcap,
    tanh,
)
from minfer.backends.cpu.kernels.elementwise.norm import (
    bind_add_rms_norm,
    bind_head_rms_norm,
    bind_layer_norm,
    bind_rms_norm,
    head_rms_norm,
    layer_norm,
    rms_norm,
)
from minfer.backends.cpu.kernels.elementwise.norm_quant import bind_norm_quant
from minfer.backends.cpu.kernels.elementwise.pool import bind_pool
from minfer.backends.cpu.kernels.elementwise.rope import bind_rope, rope, rope_neox
from minfer.backends.cpu.kernels.linear.amx import AmxWeight, amx_weight, bind_gemm_amx
from minfer.backends.cpu.kernels.linear.amx import usable as amx_usable
from minfer.backends.cpu.kernels.linear.dense import (
    DenseWeight,
    bind_gemm,
    dense_weight,
    gemm,
)
from minfer.backends.cpu.kernels.linear.dense import scratch_size as gemm_scratch_size
from minfer.backends.cpu.kernels.linear.dispatch import (
    PACKED_FORM,
    PREFILL_MIN_TOKENS,
    PrequantKernel,
    QuantizedActivation,
    bind_prequant,
    bind_prequant_into,
    bind_quantize,
    integer_weight,
    matmul,
    matmul_prequant,
    matmul_sgemm,
    new_activation,
    packable,
    prefill_min_tokens,
    quantize_activation,
    repack_weight,
    takes_bias,
)
from minfer.backends.cpu.kernels.linear.experts import ExpertWeight, bind_moe
from minfer.backends.cpu.kernels.linear.gate_up import bind_gate_up, block_values
from minfer.backends.cpu.kernels.linear.gemm_i16 import (
    I16Weight,
    bind_gemm_i16,
    i16_weight,
    int8_codes,
    q8_0_codes,
)
from minfer.backends.cpu.kernels.linear.gemm_i16 import scratch_size as gemm_i16_scratch_size
from minfer.backends.cpu.kernels.quant.activations import (
    Q8Blocks,
    Q8KBlocks,
    quantize_q8_0,
    quantize_q8_k,
)
from minfer.backends.cpu.kernels.quant.dequant import (
    bind_get_rows,
    dequantize,
    dequantize_into,
    get_rows,
)
from minfer.backends.cpu.kernels.quant.types import QType, row_bytes
from minfer.backends.cpu.kernels.recurrent.delta_net import (
    bind_delta_net,
    delta_net,
    new_delta_state,
)
from minfer.backends.cpu.kernels.recurrent.shortconv import (
    bind_short_conv,
    bind_ssm_conv,
    new_state,
    short_conv,
    ssm_conv,
)

__all__ = [
    "ATTN_BLOCKED_MIN_TOKENS",
    "PACKED_FORM",
    "PREFILL_MIN_TOKENS",
    "AmxWeight",
    "DenseWeight",
    "ExpertWeight",
    "I16Weight",
    "PrequantKernel",
    "Q8Blocks",
    "Q8KBlocks",
    "QType",
    "QuantizedActivation",
    "add",
    "amx_usable",
    "amx_weight",
    "attention",
    "bind_add",
    "bind_add_rms_norm",
    "bind_attention",
    "bind_delta_net",
    "bind_gate_up",
    "bind_gemm",
    "bind_gemm_amx",
    "bind_gemm_i16",
    "bind_get_rows",
    "bind_head_rms_norm",
    "bind_layer_norm",
    "bind_moe",
    "bind_mul",
    "bind_norm_quant",
    "bind_pool",
    "bind_prequant",
    "bind_prequant_into",
    "bind_quantize",
    "bind_rms_norm",
    "bind_rope",
    "bind_rope_store",
    "bind_sequence_attention",
    "bind_short_conv",
    "bind_silu",
    "bind_ssm_conv",
    "bind_store_kv",
    "bind_swiglu",
    "block_values",
    "delta_net",
    "dense_weight",
    "dequantize",
    "dequantize_into",
    "geglu",
    "gelu",
    "gelu_erf",
    "gemm",
    "gemm_i16_scratch_size",
    "gemm_scratch_size",
    "get_rows",
    "head_rms_norm",
    "i16_weight",
    "int8_codes",
    "integer_weight",
    "kv_store",
    "layer_norm",
    "matmul",
    "matmul_prequant",
    "matmul_sgemm",
    "mul",
    "new_activation",
    "new_delta_state",
    "new_state",
    "packable",
    "prefill_min_tokens",
    "q8_0_codes",
    "quantize_activation",
    "quantize_q8_0",
    "quantize_q8_k",
    "repack_weight",
    "rms_norm",
    "rope",
    "rope_neox",
    "round_f16",
    "row_bytes",
    "scale",
    "sequence_attention",
    "sequence_attention_scratch_size",
    "short_conv",
    "sigmoid_gate",
    "sigmoid_mul",
    "silu",
    "softcap",
    "softmax_rows",
    "ssm_conv",
    "swiglu",
    "takes_bias",
    "tanh",
]
