"""A plain numpy forward pass of every supported family: the slow, obviously-correct oracle.

Written independently of minfer's graph and kernels: weights are dequantized with the `gguf`
package's reference code and everything runs in float64 with textbook formulas. Qwen2/3 and
Llama (normal-mode RoPE, optional `rope_freqs`) share the pre-norm block; Gemma 3 adds the
embedding scale, sandwich norms, GELU(tanh) gate, sliding-window layers with their own rope
base, and the optional soft-caps.
"""

from __future__ import annotations

import gguf
import numpy as np
from gguf.quants import dequantize


def round_bf16(a: np.ndarray) -> np.ndarray:
    """a rounded to the nearest bfloat16 (ties to even), as float64."""
    bits = np.asarray(a, np.float32).view(np.uint32).astype(np.uint64)
    bits = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16 << 16
    return bits.astype(np.uint32).view(np.float32).astype(np.float64)


def load_weights(reader: gguf.GGUFReader) -> dict[str, np.ndarray]:
    """Every tensor of a GGUF dequantized to float64, in numpy (row-major) shape."""
    w: dict[str, np.ndarray] = {}
    for t in reader.tensors:
        arr = dequantize(np.asarray(t.data), t.tensor_type).astype(np.float64)
        w[t.name] = arr.reshape(tuple(int(x) for x in reversed(t.shape.tolist())))
    return w


class OracleQwen:
    """`bf16=True` models a bf16 GEMM: each weight product rounds its operands and its result
    to bfloat16 (the torch backend's arithmetic); all else stays float64."""

    def __init__(self, path: str, *, bf16: bool = False) -> None:
        self.bf16 = bf16
        reader = gguf.GGUFReader(path)
        self.w = load_weights(reader)
        arch = str(bytes(reader.fields["general.architecture"].parts[-1]), "utf-8")

        def field(key: str, default: float | None = None) -> float:
            f = reader.fields.get(f"{arch}.{key}")
            if f is None:
                assert default is not None, key
                return default
            return float(f.parts[-1][0])

        self.arch = arch
        self.window = int(field("attention.sliding_window", 0)) if arch == "gemma3" else 0
        self.base_swa = field("rope.freq_base_swa", 10000.0)
        self.attn_softcap = field("attn_logit_softcapping", 0.0)
        self.final_softcap = field("final_logit_softcapping", 0.0)
        self.norm_rope = arch == "llama"
        self.factors = self.w.get("rope_freqs.weight")

        self.n_layer = int(field("block_count"))
        self.n_embd = int(field("embedding_length"))
        self.n_head = int(field("attention.head_count"))
        self.n_head_kv = int(field("attention.head_count_kv"))
        self.head_dim = int(field("attention.key_length", self.n_embd // self.n_head))
        self.eps = field("attention.layer_norm_rms_epsilon")
        self.base = field("rope.freq_base", 10000.0)
        self.n_used = int(field("expert_used_count", 0))
        norm = reader.fields.get(f"{arch}.expert_weights_norm")
        self.expert_norm = bool(norm.parts[-1][0]) if norm is not None else arch == "qwen3moe"

    def _mm(self, x: np.ndarray, w: np.ndarray) -> np.ndarray:
        """x @ w.T for a weight w."""
        if not self.bf16:
            return x @ w.T
        return round_bf16(round_bf16(x) @ round_bf16(w).T)

    def _norm(self, x: np.ndarray, w: np.ndarray) -> np.ndarray:
        return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + self.eps) * w

    def _is_swa(self, il: int) -> bool:
        return self.window > 0 and il % 6 < 5

    def _rope(self, x: np.ndarray, pos: np.ndarray, n_head: int, base: float) -> np.ndarray:
        hd = self.head_dim
        x = x.reshape(len(pos), n_head, hd)
        half = hd // 2
        inv = base ** (-np.arange(half) * 2.0 / hd)
        if self.factors is not None:
            inv = inv / self.factors
        ang = pos[:, None] * inv[None, :]  # [nt, half]
        cos, sin = np.cos(ang)[:, None, :], np.sin(ang)[:, None, :]
        if self.norm_rope:  # adjacent pairs
            out = x.copy()
            a, b = x[..., 0::2], x[..., 1::2]
            out[..., 0::2], out[..., 1::2] = a * cos - b * sin, a * sin + b * cos
            return out.reshape(len(pos), -1)
        a, b = x[..., :half], x[..., half:]
        return np.concatenate([a * cos - b * sin, a * sin + b * cos], axis=-1).reshape(len(pos), -1)

    def _swiglu_ffn(self, x: np.ndarray, gate: np.ndarray, up: np.ndarray,
                    down: np.ndarray) -> np.ndarray:
        g, u = self._mm(x, gate), self._mm(x, up)
        return self._mm(g / (1.0 + np.exp(-g)) * u, down)

    def _moe(self, x: np.ndarray, p: str) -> np.ndarray:
        """Soft-max routing to the top n_used experts (ties: the lower id), renormalised where
        the model does it, plus Qwen2-MoE's sigmoid-gated shared expert."""
        w = self.w
        logits = self._mm(x, w[p + "ffn_gate_inp.weight"])
        probs = np.exp(logits - logits.max(axis=1, keepdims=True))
        probs /= probs.sum(axis=1, keepdims=True)
        out = np.zeros_like(x)
        for t in range(len(x)):
            top = np.argsort(-probs[t], kind="stable")[:self.n_used]
            wts = probs[t, top] / (probs[t, top].sum() if self.expert_norm else 1.0)
            for e, wt in zip(top, wts, strict=True):
                out[t] += wt * self._swiglu_ffn(x[t:t + 1], w[p + "ffn_gate_exps.weight"][e],
                                                w[p + "ffn_up_exps.weight"][e],
                                                w[p + "ffn_down_exps.weight"][e])[0]
        if p + "ffn_gate_inp_shexp.weight" in w and self.arch == "qwen2moe":
            gate = 1.0 / (1.0 + np.exp(-(x @ w[p + "ffn_gate_inp_shexp.weight"].reshape(-1))))
            out += gate[:, None] * self._swiglu_ffn(x, w[p + "ffn_gate_shexp.weight"],
                                                    w[p + "ffn_up_shexp.weight"],
                                                    w[p + "ffn_down_shexp.weight"])
        return out

    def _gelu(self, x: np.ndarray) -> np.ndarray:
        return 0.5 * x * (1.0 + np.tanh(np.sqrt(2.0 / np.pi) * (x + 0.044715 * x**3)))

    def logits(self, tokens: list[int]) -> np.ndarray:
        """Logits for every position of one sequence, [nt, n_vocab]."""
        w = self.w
        nt = len(tokens)
        pos = np.arange(nt, dtype=np.float64)
        h = w["token_embd.weight"][tokens]
        gemma = self.arch == "gemma3"
        if gemma:
            h = h * np.sqrt(self.n_embd)
        group = self.n_head // self.n_head_kv
        causal = np.triu(np.full((nt, nt), -np.inf), k=1)
        scale = 1.0 / np.sqrt(self.head_dim)
        for il in range(self.n_layer):
            mask = causal
            base = self.base
            if gemma and self._is_swa(il):
                mask = causal + np.tril(np.full((nt, nt), -np.inf), k=-self.window)
                base = self.base_swa
            p = f"blk.{il}."
            x = self._norm(h, w[p + "attn_norm.weight"])
            q = self._mm(x, w[p + "attn_q.weight"]) + w.get(p + "attn_q.bias", 0.0)
            k = self._mm(x, w[p + "attn_k.weight"]) + w.get(p + "attn_k.bias", 0.0)
            v = self._mm(x, w[p + "attn_v.weight"]) + w.get(p + "attn_v.bias", 0.0)
            if p + "attn_q_norm.weight" in w:
                q = self._norm(q.reshape(nt, -1, self.head_dim), w[p + "attn_q_norm.weight"])
                k = self._norm(k.reshape(nt, -1, self.head_dim), w[p + "attn_k_norm.weight"])
                q, k = q.reshape(nt, -1), k.reshape(nt, -1)
            q = self._rope(q, pos, self.n_head, base).reshape(nt, self.n_head, self.head_dim)
            k = self._rope(k, pos, self.n_head_kv, base).reshape(nt, self.n_head_kv, self.head_dim)
            v = v.reshape(nt, self.n_head_kv, self.head_dim)
            out = np.empty((nt, self.n_head, self.head_dim))
            for hh in range(self.n_head):
                kv = hh // group
                s = q[:, hh, :] @ k[:, kv, :].T * scale
                if self.attn_softcap:
                    s = self.attn_softcap * np.tanh(s / self.attn_softcap)
                s = s + mask
                s = np.exp(s - s.max(axis=1, keepdims=True))
                out[:, hh, :] = (s / s.sum(axis=1, keepdims=True)) @ v[:, kv, :]
            o = self._mm(out.reshape(nt, -1), w[p + "attn_output.weight"])
            if gemma:
                o = self._norm(o, w[p + "post_attention_norm.weight"])
            h = h + o
            x = self._norm(h, w[p + "ffn_norm.weight"])
            if p + "ffn_gate_inp.weight" in w:
                d = self._moe(x, p)
            else:
                g = self._mm(x, w[p + "ffn_gate.weight"])
                u = self._mm(x, w[p + "ffn_up.weight"])
                act = self._gelu(g) if gemma else g / (1.0 + np.exp(-g))
                d = self._mm(act * u, w[p + "ffn_down.weight"])
            if gemma:
                d = self._norm(d, w[p + "post_ffw_norm.weight"])
            h = h + d
        x = self._norm(h, w["output_norm.weight"])
        out_w = w.get("output.weight", w["token_embd.weight"])
        logits = self._mm(x, out_w)
        if self.final_softcap:
            logits = self.final_softcap * np.tanh(logits / self.final_softcap)
        return logits


Oracle = OracleQwen  # every family; the old name stays for the Qwen tests


class OracleBert:
    """BERT in float64 with textbook formulas: one input at a time, bidirectional attention,
    post-norm LayerNorms, exact (erf) GELU; `pool` as sentence-transformers / llama.cpp."""

    def __init__(self, path: str) -> None:
        reader = gguf.GGUFReader(path)
        self.w = load_weights(reader)

        def field(key: str) -> float:
            return float(reader.fields[f"bert.{key}"].parts[-1][0])

        self.n_layer = int(field("block_count"))
        self.n_head = int(field("attention.head_count"))
        self.eps = field("attention.layer_norm_epsilon")

    def _ln(self, x: np.ndarray, name: str) -> np.ndarray:
        mu = x.mean(axis=-1, keepdims=True)
        var = ((x - mu) ** 2).mean(axis=-1, keepdims=True)
        return (x - mu) / np.sqrt(var + self.eps) * self.w[name + ".weight"] + \
            self.w[name + ".bias"]

    def _lin(self, x: np.ndarray, name: str) -> np.ndarray:
        y = x @ self.w[name + ".weight"].T
        return y + self.w[name + ".bias"] if name + ".bias" in self.w else y

    def hidden(self, ids: list[int], types: list[int] | None = None) -> np.ndarray:
        from math import erf
        n = len(ids)
        w = self.w
        x = w["token_embd.weight"][ids] + w["position_embd.weight"][np.arange(n)]
        if "token_types.weight" in w:
            x = x + w["token_types.weight"][types if types is not None else [0] * n]
        x = self._ln(x, "token_embd_norm")
        nh = self.n_head
        hd = x.shape[1] // nh
        gelu = np.vectorize(lambda v: 0.5 * v * (1.0 + erf(v / np.sqrt(2.0))))
        for il in range(self.n_layer):
            b = f"blk.{il}."
            q, k, v = (self._lin(x, b + f"attn_{p}").reshape(n, nh, hd) for p in "qkv")
            s = np.einsum("thd,shd->hts", q, k) / np.sqrt(hd)
            p = np.exp(s - s.max(axis=-1, keepdims=True))
            p /= p.sum(axis=-1, keepdims=True)
            a = np.einsum("hts,shd->thd", p, v).reshape(n, nh * hd)
            x = self._ln(x + self._lin(a, b + "attn_output"), b + "attn_output_norm")
            f = self._lin(gelu(self._lin(x, b + "ffn_up")), b + "ffn_down")
            x = self._ln(x + f, b + "layer_output_norm")
        return x

    def pool(self, ids: list[int], kind: str, types: list[int] | None = None) -> np.ndarray:
        h = self.hidden(ids, types)
        if kind == "mean":
            return h.mean(axis=0)
        if kind == "cls":
            return h[0]
        if kind == "last":
            return h[-1]
        if kind == "rank":
            x = h[0]
            if "cls.weight" in self.w:
                x = np.tanh(self._lin(x, "cls"))
            return self._lin(x, "cls.output")
        return h


def short_conv(bcx: np.ndarray, taps: np.ndarray,
               state: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    """LFM2's gated short convolution of one sequence in float64, as a textbook causal
    depthwise convolution: bcx [nt, 3 d] = B | C | x, taps [d, L], state [L - 1, d] (the
    previous B * x rows, oldest first; zeros when None). Returns (out [nt, d], the new state)."""
    d, n_taps = taps.shape
    b, c, x = (bcx[:, i * d:(i + 1) * d].astype(np.float64) for i in range(3))
    prev = np.zeros((n_taps - 1, d)) if state is None else state.astype(np.float64)
    window = np.concatenate([prev, b * x])
    conv = np.stack([(window[t:t + n_taps] * taps.T.astype(np.float64)).sum(axis=0)
                     for t in range(len(bcx))])
    return c * conv, window[len(bcx):]


def ssm_conv(x: np.ndarray, taps: np.ndarray) -> np.ndarray:
    """Qwen3.5's causal depthwise convolution then SiLU of one sequence from a zero state, in
    float64: x [nt, d], taps [d, L]."""
    d, n_taps = taps.shape
    window = np.concatenate([np.zeros((n_taps - 1, d)), x.astype(np.float64)])
    conv = np.stack([(window[t:t + n_taps] * taps.T.astype(np.float64)).sum(axis=0)
                     for t in range(len(x))])
    return conv / (1.0 + np.exp(-conv))


def delta_net(qkv: np.ndarray, alpha: np.ndarray, beta: np.ndarray, dt_bias: np.ndarray,
              a: np.ndarray, n_k_heads: int, eps: float) -> np.ndarray:
    """The gated delta rule of one sequence from a zero state in float64, as transformers'
    `torch_recurrent_gated_delta_rule` writes it (S [d_k, d_v] per value head, value head h on
    key head h % n_k_heads, llama.cpp's tiled order): qkv [nt, (2 n_k + n_v) d]."""
    nt, n_v = alpha.shape
    d = qkv.shape[1] // (2 * n_k_heads + n_v)
    x = qkv.astype(np.float64)
    out = np.zeros((nt, n_v * d))
    state = np.zeros((n_v, d, d))
    for t in range(nt):
        for h in range(n_v):
            kh = h % n_k_heads
            q = x[t, kh * d:(kh + 1) * d]
            k = x[t, (n_k_heads + kh) * d:(n_k_heads + kh + 1) * d]
            v = x[t, (2 * n_k_heads + h) * d:(2 * n_k_heads + h + 1) * d]
            q = q / max(np.linalg.norm(q), eps)
            k = k / max(np.linalg.norm(k), eps)
            g = np.log1p(np.exp(float(alpha[t, h]) + float(dt_bias[h]))) * float(a[h])
            b = 1.0 / (1.0 + np.exp(-float(beta[t, h])))
            s = state[h] * np.exp(g)
            s = s + np.outer(k, (v - s.T @ k) * b)
            state[h] = s
            out[t, h * d:(h + 1) * d] = s.T @ q / np.sqrt(d)
    return out
