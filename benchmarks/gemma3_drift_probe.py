"""Issue 63's probe: which of ggml's float details bring Gemma-3-270M's top-10 logits within
0.5 of llama.cpp's. Not a test; a measurement harness, run by hand:

    PYTHONPATH=src .venv/bin/python benchmarks/gemma3_drift_probe.py [--variants base,q0,...]
        [--prompts 0,1,...] [--ref /tmp/gemma3_ref.npz] [--layers N]

It runs minfer's engine with some ops swapped for numpy emulations of ggml-cpu's exact float
order (the CPU backend's binders are monkeypatched in this process only), and compares each
prompt's logits at its last position with llama.cpp's (llama-cpp-python in its own interpreter,
/tmp/refvenv or MINFER_REF_PYTHON, as benchmarks/make_gemma_reference.py runs it: n_ctx 4096,
2 threads, flash attention off, f16 KV). The gap is max |minfer - llama.cpp| over llama.cpp's
top-10 tokens, the measure tests/test_gemma3_drift.py holds to 0.5.

Variants (comma-joined names combine):
- base: minfer as it is.
- q0: Q5_0 / Q8_0 projections (q/k/v, gate/up, the tied output, half the attn_v) as ggml's
  AVX2 / AVX-512 VNNI `ggml_vec_dot_q{5,8}_0_q8_0` and llamafile's tinyBLAS_Q0_AVX sum them
  (the same order in both): per output eight f32 lanes, lane j the integer sum of codes
  4j..4j+3 of each 32-block, acc_j = fma(d_w * d_x, lane_j, acc_j) block after block, then
  ((a0+a4)+(a2+a6)) + ((a1+a5)+(a3+a7)).
- q6k: Q6_K projections as ggml's AVX2 `ggml_vec_dot_q6_K_q8_K`.
- q4k: Q4_K projections as ggml's x86 repacked `q4_K_8x8_q8_K` gemv/gemm (llama.cpp repacks
  Q4_K weights on AVX2 hosts; `use_extra_bufts`).
- ga: attention in ggml's non-flash order: q * scale rounded to f16, K.q as llamafile's AVX-512
  tinyBLAS on f16 (one 16-lane f32 accumulator over the head, `_mm512_reduce_add_ps`), the
  softmax's sum in f64 of each 16-cell group's f32 reduce, times f32(1 / sum), V.p on tinyBLAS
  over the cells; exps exact (f64 rounded) and probabilities f32 unless:
- softmax: the exps as ggml's AVX-512 `ggml_v_expf` (its polynomial, bit for bit);
- p16: the probabilities rounded to f16 before the value mix (ggml's vec_dot type for f16 V);
- attn: ga + softmax + p16 (llama.cpp's layer-0 kq, kq_soft_max and kqv bit for bit from its
  own inputs).

Measured (Intel Xeon, Sapphire Rapids; llama-cpp-python 0.3.36 built as docs/performance.md
says), max top-10 gap over the 18 prompts / prompts over 0.5: base 1.129 / 5, q0 0.791 / 9,
q0+ga 0.872 / 8, q0+attn 0.867 / 6, q0+ga+p16 0.897 / 4, q0+ga+softmax 0.801 / 6, attn (alone)
0.833 / 5. With q0+attn,
layer 0's q/k/v and layer 1's q/k/v and attention output equal llama.cpp's bit for bit (--dump 1),
but the Q4_K attn_output (repacked 8x8 in llama.cpp), the Q6_K ffn_down and the norms' sums
still differ in last bits, and those seeds flip f16 / Q8 roundings downstream: every partial
match reshuffles the gaps without shrinking them. GELU already matches (ffn_geglu equal wherever
its inputs are).

With --dump N the script also compares each captured node of minfer against llama.cpp's
intermediate tensors (its eval callback) on prompt N, printing the first nodes that differ.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
from collections.abc import Callable
from pathlib import Path

import numpy as np

_CHAT = "<start_of_turn>user\n{}<end_of_turn>\n<start_of_turn>model\n"
PROMPTS = [
    "The history of the Roman Empire spans more than a thousand years, from the founding of the "
    "city to the fall of Constantinople. Historians often divide it into",
    "import numpy as np\n\ndef softmax(x):\n    e = np.exp(x - x.max())\n    return e / e.sum()\n\n"
    "def cross_entropy(logits, target):\n",
    "In a quiet town by the sea, an old lighthouse keeper named Elias kept a journal of every ship "
    "that passed. One stormy night in October, he wrote:",
    "#include <stdio.h>\n\nint main(void) {\n    int i;\n    for (i = 0; i < 10; i++) {\n        "
    "printf(\"%d\\n\", i * i);\n    }\n",
    "Machine learning is a field of study in artificial intelligence concerned with the "
    "development of statistical algorithms that can learn from data and generalize to unseen "
    "data. Recent advances in deep learning have allowed neural networks to",
    "Dear hiring manager,\n\nI am writing to apply for the position of software engineer at your "
    "company. With five years of experience in backend development,",
    "The recipe calls for two cups of flour, one teaspoon of baking soda, half a cup of butter, "
    "and",
    "SELECT customers.name, COUNT(orders.id) AS n_orders\nFROM customers\nLEFT JOIN orders ON "
    "orders.customer_id = customers.id\nWHERE",
    "Water boils at 100 degrees Celsius at sea level, but at higher altitudes the boiling point "
    "is lower because",
    "function debounce(fn, wait) {\n  let timer = null;\n  return function (...args) {\n",
] + [_CHAT.format(c) for c in (
    "Write a haiku about autumn leaves.",
    "Explain the difference between a list and a tuple in Python, with an example.",
    "What are three tips for getting better sleep?",
    "Translate 'Good morning, how are you?' into Spanish and German.",
    "Write a Python function that checks whether a string is a palindrome.",
    "Summarize the plot of Romeo and Juliet in two sentences.",
    "Why is the sky blue? Answer briefly for a ten year old child who keeps asking questions "
    "about nature and science.",
    "Give me a short JavaScript snippet that fetches JSON from a URL and logs it.",
)]

REF_PYTHON = os.environ.get("MINFER_REF_PYTHON", "/tmp/refvenv/bin/python")
MODEL = Path.home() / ".cache" / "minfer" / "gemma-3-270m.gguf"

# -- the llama.cpp side (runs in the reference interpreter) -------------------------------------


def _llama_side(model: str, out: str, dump: int) -> None:
    """Each prompt's ids and last-position logits (and, for prompt `dump` >= 0, every f32
    intermediate tensor through the eval callback) into `out`."""
    import ctypes

    import llama_cpp

    llm = llama_cpp.Llama(model, n_ctx=4096, n_threads=2, logits_all=True, flash_attn=False,
                          verbose=False)
    res: dict[str, np.ndarray] = {}
    for i, p in enumerate(PROMPTS):
        ids = llm.tokenize(p.encode(), add_bos=True, special=True)
        llm.reset()
        llm.eval(ids)
        res[f"{i}.ids"] = np.array(ids)
        res[f"{i}.logits"] = np.array(llm.scores[len(ids) - 1], np.float32)
    if dump >= 0:  # the eval callback's tensors, as a separate low-level context
        tensors: dict[str, np.ndarray] = {}

        def cb(t: int, ask: bool, ud: int) -> bool:
            base = ctypes.cast(t, ctypes.c_void_p).value
            assert base is not None
            name = ctypes.string_at(base + 256).decode(errors="replace")
            if ask:
                return True
            typ = ctypes.c_int32.from_address(base).value
            ne = [ctypes.c_int64.from_address(base + 16 + 8 * i).value for i in range(4)]
            nb = [ctypes.c_size_t.from_address(base + 48 + 8 * i).value for i in range(4)]
            data = ctypes.c_void_p.from_address(base + 248).value
            if (typ == 0 and data and nb[0] == 4 and nb[1] == 4 * ne[0]
                    and nb[2] == nb[1] * ne[1] and nb[3] == nb[2] * ne[2]):
                n = ne[0] * ne[1] * ne[2] * ne[3]
                arr = np.ctypeslib.as_array((ctypes.c_float * n).from_address(data))
                key, k = name, 0
                while key in tensors:
                    k += 1
                    key = f"{name}#{k}"
                tensors[key] = arr.reshape(ne[3], ne[2], ne[1], ne[0]).squeeze(0).copy()
            return True

        cbf = llama_cpp.ggml_backend_sched_eval_callback(cb)
        mp = llama_cpp.llama_model_default_params()
        mdl = llama_cpp.llama_model_load_from_file(model.encode(), mp)
        cp = llama_cpp.llama_context_default_params()
        cp.n_ctx = 4096
        cp.n_batch = cp.n_ubatch = 512
        cp.type_k = cp.type_v = 1
        cp.flash_attn_type = 0
        cp.n_threads = cp.n_threads_batch = 2
        cp.cb_eval = cbf
        ctx = llama_cpp.llama_init_from_model(mdl, cp)
        ids = [int(t) for t in res[f"{dump}.ids"]]
        arr = (llama_cpp.llama_token * len(ids))(*ids)
        assert llama_cpp.llama_decode(ctx, llama_cpp.llama_batch_get_one(arr, len(ids))) == 0
        res.update({f"t.{k}": v for k, v in tensors.items()})
    np.savez(out, **res)


def reference(path: Path, dump: int) -> dict[str, np.ndarray]:
    if not path.exists():
        subprocess.run([REF_PYTHON, __file__, "--llama-side", str(MODEL), str(path), str(dump)],
                       check=True)
    with np.load(path) as z:
        return {k: z[k] for k in z.files}


# -- ggml's arithmetic in numpy ------------------------------------------------------------------

F32, F64 = np.float32, np.float64


def _f16(raw: np.ndarray) -> np.ndarray:
    """Little-endian f16 bytes [..., 2] as f32."""
    return np.ascontiguousarray(raw).view(np.float16)[..., 0].astype(F32)


def q8_0_activation(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """ggml's x86 `quantize_row_q8_0`: codes [t, nb, 32] int32 and d [t, nb] (f16 values)."""
    xb = x.reshape(x.shape[0], -1, 32).astype(F32)
    amax = np.abs(xb).max(-1)
    d = (amax / F32(127)).astype(F32)
    with np.errstate(divide="ignore"):
        idv = np.where(amax != 0, F32(127) / amax, F32(0)).astype(F32)
    q = np.rint(xb * idv[..., None]).astype(np.int32)
    return q, d.astype(np.float16).astype(F32)


def q0_weight(raw: np.ndarray, qtype: int) -> tuple[np.ndarray, np.ndarray]:
    """A Q8_0 (8) / Q5_0 (6) matrix's codes [r, nb, 32] int8 and scales [r, nb] f32."""
    r = raw.shape[0]
    if qtype == 8:
        b = raw.reshape(r, -1, 34)
        return b[:, :, 2:].view(np.int8).astype(np.int8), _f16(b[:, :, :2])
    assert qtype == 6
    b = raw.reshape(r, -1, 22)
    qh = np.ascontiguousarray(b[:, :, 2:6]).view(np.uint32)[..., 0]
    qs = b[:, :, 6:22]
    lo = np.concatenate([qs & 0xF, qs >> 4], axis=-1).astype(np.int16)
    hi = ((qh[..., None] >> np.arange(32, dtype=np.uint32)) & 1).astype(np.int16)
    return (lo | (hi << 4)) - 16, _f16(b[:, :, :2])


def _hsum8(a: np.ndarray) -> np.ndarray:
    """ggml's `hsum_float_8` over the first axis (8 lanes), in f32."""
    return ((a[0] + a[4]) + (a[2] + a[6])) + ((a[1] + a[5]) + (a[3] + a[7]))


def ggml_q0_dot(x: np.ndarray, wq: np.ndarray, wd: np.ndarray, chunk: int = 16384) -> np.ndarray:
    """out[t, r] as ggml's AVX2/VNNI Q8_0-activation dots (vec_dot and tinyBLAS_Q0_AVX)."""
    xq, xd = q8_0_activation(x)
    t, nb = xd.shape
    xl = xq.reshape(t, nb * 8, 4).transpose(1, 0, 2).astype(F64)  # [L, t, 4]
    out = np.empty((t, wq.shape[0]), F32)
    for r0 in range(0, wq.shape[0], chunk):
        w = wq[r0:r0 + chunk]
        rr = w.shape[0]
        wl = w.reshape(rr, nb * 8, 4).transpose(1, 2, 0).astype(F64)  # [L, 4, r]
        lanes = np.matmul(xl, wl).reshape(nb, 8, t, rr)  # exact integer sums
        d = (xd[:, None, :] * wd[None, r0:r0 + chunk, :]).astype(F32)  # [t, r, nb]
        acc = np.zeros((8, t, rr), F32)
        for b in range(nb):  # fma: the f64 product is exact, one rounding to f32
            acc = (lanes[b] * d[None, :, :, b].astype(F64) + acc).astype(F32)
        out[:, r0:r0 + chunk] = _hsum8(acc)
    return out


def _reduce16(a: np.ndarray) -> np.ndarray:
    """`_mm512_reduce_add_ps` over the last axis (16 lanes), in f32: halves, then quarters..."""
    b = a[..., :8] + a[..., 8:]
    c = b[..., :4] + b[..., 4:]
    d = c[..., :2] + c[..., 2:]
    return d[..., 0] + d[..., 1]


def _fma(a: np.ndarray, b: np.ndarray, c: np.ndarray) -> np.ndarray:
    return (a.astype(F64) * b.astype(F64) + c.astype(F64)).astype(F32)


def tinyblas16(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """sum_l a[..., l] * b[..., l] as llamafile's AVX-512 tinyBLAS on f16 operands (products
    exact in f32): one 16-lane accumulator stepping 16 values at a time, then the reduce."""
    prod = (a * b).astype(F32)
    k = prod.shape[-1]
    prod = prod.reshape(*prod.shape[:-1], k // 16, 16)
    acc = np.zeros((*prod.shape[:-2], 16), F32)
    for c in range(k // 16):
        acc = (acc + prod[..., c, :]).astype(F32)
    return _reduce16(acc)


def _h(v: str) -> float:
    return float.fromhex(v)


def v_expf(x: np.ndarray) -> np.ndarray:
    """ggml's AVX-512 `ggml_v_expf`."""
    x = x.astype(F32)

    def c(v: str | float) -> np.ndarray:
        return np.full_like(x, _h(v) if isinstance(v, str) else v)

    r = F32(_h("0x1.8p23"))
    with np.errstate(invalid="ignore", over="ignore"):
        z = _fma(x, c("0x1.715476p+0"), np.full_like(x, r))
        n = (z - r).astype(F32)
        b = _fma(-n, c("0x1.7f7d1cp-20"), _fma(-n, c("0x1.62e4p-1"), x))
        u = (b * b).astype(F32)
        j = _fma(_fma(_fma(c("0x1.0e4020p-7"), b, c("0x1.573e2ep-5")), u,
                      _fma(c("0x1.555e66p-3"), b, c("0x1.fffdb6p-2"))),
                 u, _fma(c("0x1.ffffecp-1"), b, c(1.0)))
        res = np.ldexp(j, np.nan_to_num(n, posinf=0, neginf=0).astype(np.int32)).astype(F32)
        big = np.abs(n) > 192
        return np.where(big, np.where(n <= 0, F32(0), F32(np.inf)), res).astype(F32)


def ggml_attention(q: np.ndarray, kc: np.ndarray, vc: np.ndarray, kv_start: np.ndarray,
                   kv_end: np.ndarray, n_head: int, n_head_kv: int, hd: int, scale: float,
                   window: int, variants: set[str]) -> np.ndarray:
    """llama.cpp's non-flash attention over an f16 cache: q * scale rounded to f16, K.q on
    tinyBLAS, ggml_soft_max_ext (vectorised expf in 16-cell groups, the f64 sum of each
    group's f32 reduce, times f32(1/sum)), the probabilities rounded to f16, V.p on tinyBLAS."""
    t = q.shape[0]
    out = np.empty((t, n_head * hd), F32)
    hi_all = int(kv_end.max())
    n = (hi_all + 15) // 16 * 16
    k = np.zeros((n, kc.shape[1]), F32)
    v = np.zeros((n, vc.shape[1]), F32)
    k[:hi_all] = kc[:hi_all].astype(F32)
    v[:hi_all] = vc[:hi_all].astype(F32)
    group = n_head // n_head_kv
    for i in range(t):
        lo, hi = int(kv_start[i]), int(kv_end[i])
        if window:
            lo = max(lo, hi - window)
        mask = np.full(n, -np.inf, F32)
        mask[lo:hi] = 0
        for h in range(n_head):
            g = h // group
            qh = (q[i, h * hd:(h + 1) * hd] * F32(scale)).astype(np.float16).astype(F32)
            kk = k[:, g * hd:(g + 1) * hd]
            s = tinyblas16(qh[None, :], kk) + mask
            mx = s.max()
            e = v_expf((s - mx).astype(F32)) if "softmax" in variants else \
                np.exp((s - mx).astype(F64)).astype(F32)
            tot = float(np.sum(_reduce16(e.reshape(-1, 16)).astype(F64)))
            p = (e * F32(1.0 / tot)).astype(F32)
            p16 = p.astype(np.float16).astype(F32) if "p16" in variants else p
            vv = v[:, g * hd:(g + 1) * hd]  # [n, hd]
            out[i, h * hd:(h + 1) * hd] = tinyblas16(p16[None, :], vv.T)
    return out


# -- hooking the CPU backend ---------------------------------------------------------------------

Emulation = Callable[[np.ndarray, np.ndarray, int], np.ndarray | None]


def install(variants: set[str]) -> None:
    """Monkeypatch the CPU backend's projection binder (and attention where asked)."""
    from minfer.backends.cpu import backend as be

    original = be._bind_project
    cache: dict[str, tuple[np.ndarray, np.ndarray]] = {}

    def bind_project(w_name: str, x_node: int, x: np.ndarray, out: np.ndarray,
                     ctx: object, rows: int = 0) -> list[Callable[[], None]]:
        raw, qtype = ctx.weights.matrix(w_name)  # type: ignore[attr-defined]
        if "q0" in variants and qtype in (6, 8):
            if w_name not in cache:
                cache[w_name] = q0_weight(np.asarray(raw), qtype)
            wq, wd = cache[w_name]
            if rows:
                wq, wd = wq[:rows], wd[:rows]

            def step() -> None:
                out[...] = ggml_q0_dot(x, wq, wd)
            return [step]
        return original(w_name, x_node, x, out, ctx, rows)  # type: ignore[arg-type]

    be._bind_project = bind_project
    if "ga" in variants:
        from minfer.graph import ir

        def bind_attn(node: object, srcs: list[np.ndarray], out: np.ndarray,
                      ctx: object) -> list[Callable[[], None]]:
            op = node.op  # type: ignore[attr-defined]
            kc = ctx.kv.k[op.cache_layer]  # type: ignore[attr-defined]
            vc = ctx.kv.v[op.cache_layer]  # type: ignore[attr-defined]
            assert kc.dtype == np.float16 and not op.softcap and not op.sinks

            def step() -> None:
                out[...] = ggml_attention(srcs[0], kc, vc, srcs[2], srcs[3], op.n_head,
                                          op.n_head_kv, op.head_dim, op.scale, op.window,
                                          variants)
            return [step]
        be._BINDERS[ir.Attn] = bind_attn


# -- running -------------------------------------------------------------------------------------


def new_engine() -> object:
    from minfer.engine.forward import Engine
    from minfer.gguf.hparams import HParams
    from minfer.gguf.reader import GGUFFile
    from minfer.store.download import pull

    f = GGUFFile.open(pull("gemma-3-270m", progress=False))
    return Engine(f, HParams.from_gguf(f), n_ctx=256)


def gap(logits: np.ndarray, ref: np.ndarray) -> float:
    top = np.argsort(ref)[::-1][:10]
    return float(np.abs(logits[top] - ref[top]).max())


def compare_nodes(engine: object, ids: list[int], ref: dict[str, np.ndarray]) -> None:
    """minfer's captured nodes against llama.cpp's tensors of the same role, first layers."""
    from minfer.engine.trace import StepTracer

    engine.tracer = StepTracer(capture=True)  # type: ignore[attr-defined]
    engine.forward(ids, 0)  # type: ignore[attr-defined]
    tr = engine.tracer  # type: ignore[attr-defined]
    step = tr.steps[-1]
    g = tr.prepared[step.header["graph"]].graph
    mf: dict[str, np.ndarray] = {}
    for nid, arr in step.outputs.items():
        n = g.nodes[nid]
        key = f"{n.name}-{n.meta.layer}" if n.meta.layer >= 0 else n.name
        while key in mf:
            key += "#"
        mf[key] = arr
    engine.tracer = None  # type: ignore[attr-defined]
    for il in range(3):
        for a, b in ((f"attn_norm-{il}", f"attn_norm-{il}"), (f"attn_q-{il}", f"Qcur-{il}"),
                     (f"attn_k-{il}", f"Kcur-{il}"), (f"attn_v-{il}", f"Vcur-{il}"),
                     (f"attn.{il}-{il}", f"kqv_out-{il}"), (f"attn_output-{il}", None),
                     (f"attn_resid-{il}", f"sa_out-{il}"), (f"ffn_norm-{il}", f"ffn_norm-{il}"),
                     (f"ffn_geglu-{il}", f"ffn_geglu-{il}"), (f"ffn_down-{il}", f"ffn_out-{il}"),
                     (f"ffn_resid-{il}", f"l_out-{il}")):
            if b is None:  # the attention output projection has no name of its own
                names = [k[2:] for k in ref if k.startswith("t.")]
                b = names[names.index(f"kqv_out-{il}") + 1]
            x, y = mf.get(a), ref.get("t." + b)
            if x is None or y is None:
                print(f"  {a:18s} {b:18s} missing")
                continue
            y = y.reshape(y.shape[-2], -1) if y.shape[0] == 1 else y.reshape(y.shape[0], -1)
            n = min(x.shape[0], y.shape[0])
            x, y = x[-n:].reshape(n, -1), y[-n:]
            d = np.abs(x - y)
            print(f"  {a:18s} {b:18s} neq {np.count_nonzero(d):7d}/{d.size:7d} "
                  f"max {d.max():.3e} rel {d.max() / (np.abs(y).max() + 1e-30):.2e}")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--llama-side", nargs=3)
    ap.add_argument("--variants", default="base,q0")
    ap.add_argument("--prompts", default="")
    ap.add_argument("--ref", default="/tmp/gemma3_drift_ref.npz")
    ap.add_argument("--dump", type=int, default=-1)
    a = ap.parse_args()
    if a.llama_side:
        _llama_side(a.llama_side[0], a.llama_side[1], int(a.llama_side[2]))
        return
    ref = reference(Path(a.ref), a.dump)
    chosen = [int(i) for i in a.prompts.split(",")] if a.prompts else range(len(PROMPTS))
    variant = set(a.variants.split("+"))
    if "attn" in variant:
        variant |= {"ga", "softmax", "p16"}
    install(variant)
    engine = new_engine()
    if a.dump >= 0:
        compare_nodes(engine, [int(t) for t in ref[f"{a.dump}.ids"]], ref)
    gaps = {}
    for i in chosen:
        ids = [int(t) for t in ref[f"{i}.ids"]]
        logits = engine.forward(ids, 0)[0]  # type: ignore[attr-defined]
        gaps[i] = gap(logits, ref[f"{i}.logits"])
        print(f"{a.variants:14s} prompt {i:2d} n={len(ids):3d} gap {gaps[i]:.3f}", flush=True)
    print(json.dumps({"variant": a.variants, "gaps": gaps,
                      "max": max(gaps.values()), "over": sum(g > 0.5 for g in gaps.values())}))


if __name__ == "__main__":
    main()
