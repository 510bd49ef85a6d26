"""Regenerate tests/fixtures/moe/: tiny random mixture-of-experts Qwen checkpoints converted by
llama.cpp, with transformers' and llama.cpp's logits and greedy continuations on the same ids.

    PYTHONPATH=$PWD/src .venv/bin/python benchmarks/make_moe_fixtures.py \
        --convert /path/to/llama.cpp/convert_hf_to_gguf.py \
        --gguf-py /path/to/llama.cpp/gguf-py --ref-python /tmp/refvenv/bin/python [--quantized]

Each model is made by `transformers` (random weights, seed 0, 2 layers, n_embd 256 so every
matrix can be quantized to 256-wide K-quant blocks, 8 experts of FFN width 256 with 2 used per
token, norms 1 + 0.1 randn, q/k/v biases 0.1 randn where present, weights of std 1/16 so each
matrix has gain about 1: at std 0.15 the attention saturates and Q8_0 weights alone moved the
logits by up to 4, at 1/16 by 0.1) and given the 320-piece
byte-level BPE tokenizer of tests/hf_tiny.py, whose pre-tokenizer hash llama.cpp does not know,
so its converter is told it is "qwen2". The routers are then redrawn ROUTER_DRAWS times (float32
normals, seeds 1000 + i) and the draw whose routing on IDS and on the greedy continuation is
farthest from a tie (k-th vs (k+1)-th router logit, in units of the call's logit std) is kept,
so the expert choice survives float32 rounding and Q8_0 weights. The model is run on IDS by
transformers in float64 (eager attention and experts; the routers' softmax, which transformers
does in float32, is float64 here), saved as float32 safetensors, converted by llama.cpp's own
`convert_hf_to_gguf.py --outtype f32` and run by llama.cpp (llama-cpp-python in `--ref-python`,
flash-attn off, f32 KV). Models:

- `qwen3moe`: Qwen3MoeConfig, top-k routing weights renormalized (norm_topk_prob, which
  llama.cpp's qwen3moe graph always does), q/k norms, untied output;
- `qwen2moe`: Qwen2MoeConfig, top-k softmax weights not renormalized (llama.cpp's qwen2moe
  graph never does), a shared expert (FFN width 512) scaled by sigmoid(shared_expert_gate · x),
  q/k/v biases, untied output;
- `mixtral`: MixtralConfig, which llama.cpp's converter writes as a `llama` file with
  `llama.expert_count` (experts as wide as `feed_forward_length`), top-k weights renormalized,
  llama's rope (adjacent pairs), untied output.

`--only NAME ...` remakes just those models, keeping the other files and arrays.

`logits.npz` holds `ids`, `<name>.hf` and `<name>.llamacpp` (float32 logits at every position
of IDS), `<name>.greedy` (llama.cpp's greedy argmax continuation of IDS, N_NEW tokens, int32)
and `<name>.hf_greedy` (the same from transformers in float64). With `--quantized` it also
holds `<name>.q8_0.llamacpp`, `<name>.q4_k_m.llamacpp` and `<name>.q4_k.llamacpp`: llama.cpp's
logits on IDS after its own quantizer (llama_model_quantize) made Q8_0, Q4_K_M and pure Q4_K
files from the f32 GGUF (those files are not kept). The GGUF files and `logits.npz` are
committed, so the tests need neither transformers nor llama.cpp.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "tests" / "fixtures" / "moe"
IDS = [1, 17, 250, 33, 99, 5, 301, 42, 77, 128, 64, 200, 3, 150, 11, 290]
N_VOCAB = 320
N_NEW = 24
ROUTER_DRAWS = 40

_CONVERT = """
import json, runpy, sys
convert, gguf_py, jobs = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
sys.path[:0] = [str(__import__("pathlib").Path(convert).parent), gguf_py]
import conversion.base as base
# The tiny tokenizer's hash is unknown to llama.cpp: name its pre-tokenizer.
base.TextModel.get_vocab_base_pre = lambda self, tokenizer: "qwen2"
for model_dir, out in jobs:
    sys.argv = [convert, model_dir, "--outfile", out, "--outtype", "f32"]
    try:
        runpy.run_path(convert, run_name="__main__")
    except SystemExit as exc:
        if exc.code:
            raise
"""

_LLAMACPP = """
import sys, json, numpy as np, llama_cpp
path, ids, n_new = sys.argv[1], json.loads(sys.argv[2]), int(sys.argv[3])
m = llama_cpp.Llama(path, n_ctx=64, logits_all=True, verbose=False, n_threads=2,
                    flash_attn=False, type_k=0, type_v=0)
m.eval(ids)
np.save(sys.argv[4], np.array(m.scores[:len(ids)], dtype=np.float32))
greedy = []
for _ in range(n_new):
    greedy.append(int(np.argmax(m.scores[m.n_tokens - 1])))
    m.eval(greedy[-1:])
np.save(sys.argv[5], np.array(greedy, dtype=np.int32))
"""

_QUANTIZE = """
import ctypes, sys, json, numpy as np, llama_cpp
src, dst, ftype, pure, ids = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4] == "1", \
    json.loads(sys.argv[5])
params = llama_cpp.llama_model_quantize_default_params()
params.ftype, params.pure, params.nthread = ftype, pure, 2
rc = llama_cpp.llama_model_quantize(src.encode(), dst.encode(), ctypes.byref(params))
assert rc == 0, f"llama_model_quantize returned {rc}"
m = llama_cpp.Llama(dst, n_ctx=64, logits_all=True, verbose=False, n_threads=2,
                    flash_attn=False, type_k=0, type_v=0)
m.eval(ids)
np.save(sys.argv[6], np.array(m.scores[:len(ids)], dtype=np.float32))
"""
# name: (llama_ftype, pure). 7 is LLAMA_FTYPE_MOSTLY_Q8_0, 15 LLAMA_FTYPE_MOSTLY_Q4_K_M (its mix of
# Q4_K, Q5_K, Q6_K, Q8_0); pure Q4_K_M makes every quantized tensor Q4_K.
_QUANT_TYPES = {"q8_0": (7, False), "q4_k_m": (15, False), "q4_k": (15, True)}


def _configs() -> dict[str, object]:
    from transformers import MixtralConfig, Qwen2MoeConfig, Qwen3MoeConfig

    common = {"vocab_size": N_VOCAB, "hidden_size": 256, "intermediate_size": 256,
              "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
              "max_position_embeddings": 256, "rms_norm_eps": 1e-6, "initializer_range": 1 / 16,
              "num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 256,
              "decoder_sparse_step": 1, "mlp_only_layers": [], "tie_word_embeddings": False,
              "rope_parameters": {"rope_type": "default", "rope_theta": 1e6}}
    return {
        "qwen3moe": Qwen3MoeConfig(**common, head_dim=64, norm_topk_prob=True),
        "qwen2moe": Qwen2MoeConfig(**common, shared_expert_intermediate_size=512,
                                   norm_topk_prob=False, qkv_bias=True),
        "mixtral": MixtralConfig(
            vocab_size=N_VOCAB, hidden_size=256, intermediate_size=256, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
            rms_norm_eps=1e-5, initializer_range=1 / 16, num_local_experts=8,
            num_experts_per_tok=2, tie_word_embeddings=False,
            rope_parameters={"rope_type": "default", "rope_theta": 1e6}),
    }


def _router_forward(self, hidden_states):  # transformers' TopKRouter, softmax in float64
    import torch

    hidden_states = hidden_states.reshape(-1, self.hidden_dim)
    logits = torch.nn.functional.linear(hidden_states, self.weight)
    self.seen.append(logits.detach())
    top, idx = torch.topk(torch.softmax(logits, dim=-1), self.top_k, dim=-1)
    if getattr(self, "norm_topk_prob", True):  # (Mixtral's router always renormalises)
        top = top / top.sum(dim=-1, keepdim=True)
    return logits, top, idx


def _run(model, routers: list) -> dict[str, object]:
    """Logits on IDS, the greedy continuation and how close its decisions came to ties: the
    smallest gap between the k-th and (k+1)-th router logit (absolute, and in units of that
    call's logit std) and between the top two output logits along the greedy path."""
    import torch

    with torch.no_grad():
        logits = model(torch.tensor([IDS])).logits[0].numpy()
        seq, top_gap = list(IDS), float("inf")
        for _ in range(N_NEW):
            last = model(torch.tensor([seq])).logits[0, -1].numpy()
            top2 = np.sort(last)[-2:]
            top_gap = min(top_gap, float(top2[1] - top2[0]))
            seq.append(int(np.argmax(last)))
    gap, rel = float("inf"), float("inf")
    for r in routers:
        for lg in r.seen:
            top = torch.topk(lg, r.top_k + 1, dim=-1).values
            g = top[:, -2] - top[:, -1]
            gap, rel = min(gap, float(g.min())), min(rel, float((g / lg.std(dim=-1)).min()))
        r.seen = []
    return {"logits": logits, "greedy": seq[len(IDS):], "router_gap": gap, "router_rel": rel,
            "top_gap": top_gap}


def _hf_reference(model, name: str, std: float) -> dict[str, np.ndarray]:
    """Run `model` in float64 with routers redrawn: of ROUTER_DRAWS draws (float32 normals of
    `std`, seeds 1000 + i) the one whose routing is farthest from a tie on IDS and its greedy
    continuation, so that the expert choice survives rounding and Q8_0 weights."""
    import torch

    routers = [m for m in model.modules() if type(m).__name__.endswith("TopKRouter")]
    for r in routers:
        r.forward, r.seen = _router_forward.__get__(r), []
    model.double().eval()
    best = (-1.0, 0)
    for i in range(ROUTER_DRAWS):
        gen = torch.Generator().manual_seed(1000 + i)
        with torch.no_grad():
            for r in routers:
                r.weight.copy_(torch.randn(r.weight.shape, generator=gen) * std)
        best = max(best, (_run(model, routers)["router_rel"], i))
    gen = torch.Generator().manual_seed(1000 + best[1])
    with torch.no_grad():
        for r in routers:
            r.weight.copy_(torch.randn(r.weight.shape, generator=gen) * std)
    res = _run(model, routers)
    print(f"{name}: router seed {1000 + best[1]}; smallest k-th vs (k+1)-th router logit gap "
          f"{res['router_gap']:.4f} ({res['router_rel']:.4f} logit std); smallest top-1 vs "
          f"top-2 logit gap along the greedy path {res['top_gap']:.4f}")
    return {f"{name}.hf": res["logits"].astype(np.float32),
            f"{name}.hf_greedy": np.array(res["greedy"], np.int32)}


def _describe(path: Path, gguf_py: str) -> None:
    if gguf_py not in sys.path:
        sys.path.insert(0, gguf_py)
    import gguf

    reader = gguf.GGUFReader(path)
    print(f"{path.name}: {path.stat().st_size} bytes")
    for key, field in reader.fields.items():
        if "expert" in key or key.endswith((".architecture", "freq_base")):
            print(f"  {key} = {field.contents()}")
    for t in reader.tensors:
        if t.name.startswith("blk.0.") or not t.name.startswith("blk."):
            print(f"  {t.name:28s} ne={[int(d) for d in t.shape]} {t.tensor_type.name}")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--convert", required=True, help="llama.cpp's convert_hf_to_gguf.py")
    ap.add_argument("--gguf-py", required=True, help="llama.cpp's gguf-py folder")
    ap.add_argument("--ref-python", required=True, help="python with llama-cpp-python")
    ap.add_argument("--quantized", action="store_true",
                    help="also llama.cpp's logits on its own Q8_0 and Q4_K_M quantizations")
    ap.add_argument("--only", nargs="+", metavar="NAME",
                    help="remake only these models, keeping the others' files and arrays")
    args = ap.parse_args()
    import torch
    from transformers import AutoModelForCausalLM

    sys.path.insert(0, str(ROOT / "tests"))
    from hf_tiny import write_bpe_tokenizer

    OUT.mkdir(parents=True, exist_ok=True)
    arrays: dict[str, np.ndarray] = {"ids": np.array(IDS, np.int32)}
    names = args.only or list(_configs())
    if args.only:
        kept = np.load(OUT / "logits.npz")
        arrays.update({k: kept[k] for k in kept.files if k.split(".")[0] not in names})
    with tempfile.TemporaryDirectory() as tmp:
        jobs = []
        for name, config in _configs().items():
            if name not in names:
                continue
            torch.manual_seed(0)
            hf = Path(tmp) / name
            hf.mkdir()
            model = AutoModelForCausalLM.from_config(config, attn_implementation="eager",
                                                     experts_implementation="eager")
            with torch.no_grad():  # norms away from 1 and biases away from 0, so a wrong one shows
                for p_name, p in model.named_parameters():
                    if p_name.endswith("norm.weight"):
                        p.copy_(1.0 + 0.1 * torch.randn_like(p))
                    elif p_name.endswith("bias"):
                        p.copy_(0.1 * torch.randn_like(p))
            arrays.update(_hf_reference(model, name, config.initializer_range))
            model.float().save_pretrained(hf)  # float32 weights, as the float64 run used
            write_bpe_tokenizer(hf, vocab_size=N_VOCAB)
            jobs.append([str(hf), str(OUT / f"{name}.gguf")])
        subprocess.run([sys.executable, "-c", _CONVERT, args.convert, args.gguf_py,
                        json.dumps(jobs)], check=True, stdout=subprocess.DEVNULL)
        for name in names:
            gguf_path = OUT / f"{name}.gguf"
            _describe(gguf_path, args.gguf_py)
            logits, greedy = Path(tmp) / f"{name}.npy", Path(tmp) / f"{name}.greedy.npy"
            subprocess.run([args.ref_python, "-c", _LLAMACPP, str(gguf_path), json.dumps(IDS),
                            str(N_NEW), str(logits), str(greedy)], check=True)
            arrays[f"{name}.llamacpp"] = np.load(logits)
            arrays[f"{name}.greedy"] = np.load(greedy)
            diff = np.abs(arrays[f"{name}.hf"] - arrays[f"{name}.llamacpp"]).max()
            agree = np.array_equal(arrays[f"{name}.greedy"], arrays[f"{name}.hf_greedy"])
            print(f"{name}: max |hf - llamacpp| {diff:.3g} (logits up to "
                  f"{np.abs(arrays[f'{name}.hf']).max():.3g}); greedy agrees: {agree}\n"
                  f"  llama.cpp greedy {arrays[f'{name}.greedy'].tolist()}\n"
                  f"  hf greedy        {arrays[f'{name}.hf_greedy'].tolist()}")
            for quant, (ftype, pure) in _QUANT_TYPES.items() if args.quantized else ():
                qpath, out = Path(tmp) / f"{name}.{quant}.gguf", Path(tmp) / f"{name}.{quant}.npy"
                subprocess.run([args.ref_python, "-c", _QUANTIZE, str(gguf_path), str(qpath),
                                str(ftype), str(int(pure)), json.dumps(IDS), str(out)], check=True,
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
                _describe(qpath, args.gguf_py)
                arrays[f"{name}.{quant}.llamacpp"] = q = np.load(out)
                print(f"{name}.{quant}: max |hf - llamacpp| "
                      f"{np.abs(arrays[f'{name}.hf'] - q).max():.3g}, argmax agrees with hf at "
                      f"{int((q.argmax(-1) == arrays[f'{name}.hf'].argmax(-1)).sum())}/{len(IDS)}")
    np.savez_compressed(OUT / "logits.npz", **arrays)  # type: ignore[arg-type]


if __name__ == "__main__":
    main()
