"""Greedy text of minfer against llama.cpp on the same GGUF files (#65: "greedy equal except at
near-ties" on every weight type). Not a test; a measurement, run by hand:

    PYTHONPATH=src .venv/bin/python benchmarks/greedy_vs_llamacpp.py \
        [FILE.gguf ... | --types Q2_K,IQ1_S,...] [--dir ~/.cache/minfer/qtypes-1.5b] [-n 32] \
        [--json out.json] [--layers]
    PYTHONPATH=src .venv/bin/python benchmarks/greedy_vs_llamacpp.py --table a.json b.json

With no files and no --types it runs every `*.gguf` in --dir but imatrix.gguf (the files
benchmarks/type_roofline.py makes: the dev model requantized by llama-quantize --pure).

Per file and prompt (PROMPTS: raw code, raw prose, and a chat-templated code question, rendered
by minfer's chat template; minfer's token ids go to both engines, and llama.cpp's own
tokenization of the text is checked equal), both engines decode `-n` tokens greedily, each from
its own picks. llama.cpp runs through llama-cpp-python in its own interpreter (`--ref-python`,
default $MINFER_REF_PYTHON or /tmp/refvenv/bin/python) as the committed references were made:
n_ctx 512, 2 threads, flash attention off, f16 KV, the prompt as one batch, logits of the last
row only. minfer: the CPU backend, f16 KV, 2 threads.

Reported: the steps equal from the start (N: the whole run equal); at the first divergent step
(both engines still on the same context there) each engine's top-2 ids and logits and its
margin; and the drift: max |minfer - llama.cpp| over llama.cpp's top-10 tokens (the dense
references' measure, held to 0.5 there) and over the whole vocabulary, at every step the two
share a context (up to and with the divergent step; `before` / `at` split it there).

A divergence is a near-tie when both engines' margins are below `--near-tie` (default 0.1):
where llama.cpp picks a and minfer b, llama.cpp's margin L[a] - L[b] plus minfer's M[b] - M[a]
is exactly (L - M)[a] - (L - M)[b], so two margins under 0.1 need the two engines' logits to
move apart by under 0.2 on those two tokens, well inside the 0.5 the dense references already
accept between llama.cpp's own configurations (tests/test_reference_llamacpp.py).

A divergence above it is a real difference to explain. The script measures llama.cpp's own
spread there: the same context through llama.cpp with the prompt one token at a time and with
an f32 KV (ALT_CONFIGS), each one's top-10 drift from llama.cpp's default and the two picks'
margin; minfer's drift "within llama.cpp's own spread" when at most SPREAD_FACTOR (1.5) times
the larger (two samples of a spread, not a bound), else UNEXPLAINED. `--layers` adds, per
layer, the last row's output of minfer and of llama.cpp one token at a time against llama.cpp's
default (rms of the difference / rms), through llama.cpp's eval callback: a minfer bug shows as
a step in the first column where the second has none.
`--table` prints the table of earlier `--json` files (docs/performance.md's).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path
from typing import Any

import numpy as np

PROMPTS: list[tuple[str, str]] = [  # (name, raw text; "chat:" + a user message to template)
    ("code", "import numpy as np\n\n# compute the mean of a list of numbers\ndef mean(xs):"),
    ("prose", "Once upon a time, in a small village,"),
    ("chat", "chat:Write a Python function that checks whether a string is a palindrome."),
]
N_CTX = 512
THREADS = 2
NEAR_TIE = 0.1
# llama.cpp's own spread, the yardstick of a divergence above the near-tie bound: the same file
# and context through two other configurations of llama.cpp (GGML_TYPE_F32 = 0)
ALT_CONFIGS: dict[str, dict[str, int]] = {
    "ubatch1": {"n_batch": 1, "n_ubatch": 1},  # the prompt one token at a time (decode's path)
    "f32kv": {"type_k": 0, "type_v": 0},
}
SPREAD_FACTOR = 1.5

LLAMA_SCRIPT = textwrap.dedent(
    """
    import json, sys
    import numpy as np
    import llama_cpp
    path, spec, out = sys.argv[1:4]
    spec = json.loads(open(spec).read())
    kw = dict(n_ctx=spec["n_ctx"], n_threads=spec["threads"], n_threads_batch=spec["threads"],
              n_batch=512, n_ubatch=512, flash_attn=False, logits_all=False, verbose=False)
    kw.update(spec["config"])
    llm = llama_cpp.Llama(path, **kw)
    n_vocab = llm.n_vocab()
    res = {"version": np.array(llama_cpp.__version__)}
    for i, p in enumerate(spec["prompts"]):
        res[f"{i}.tokenized"] = np.array(llm.tokenize(p["text"].encode(), add_bos=True,
                                                      special=True))
        llm.reset()
        llm._ctx.kv_cache_clear()
        ids, steps, picks = list(p["ids"]), [], []
        for _ in range(spec["n"]):
            llm.eval(ids[-1:] if picks else ids)
            row = np.ctypeslib.as_array(llm._ctx.get_logits_ith(-1), shape=(n_vocab,)).copy()
            steps.append(row)
            picks.append(int(np.argmax(row)))
            ids.append(picks[-1])
        res[f"{i}.logits"] = np.stack(steps)
        res[f"{i}.greedy"] = np.array(picks)
    np.savez(out, **res)
    print(json.dumps({"ok": True}))
    """
)


LAYERS_SCRIPT = textwrap.dedent(
    """
    import ctypes, json, sys
    import numpy as np
    import llama_cpp
    path, spec, out = sys.argv[1:4]
    spec = json.loads(open(spec).read())
    ids, res = spec["ids"], {}
    for name, nb in (("default", 512), ("ubatch1", 1)):
        rows = {}
        def cb(t, ask, ud):  # the last token's row of each layer's output (ggml_tensor's fields)
            base = ctypes.cast(t, ctypes.c_void_p).value
            name_ = ctypes.string_at(base + 256).decode(errors="replace")
            if ask:
                return name_.startswith("l_out-")
            ne0, ne1 = (ctypes.c_int64.from_address(base + 16 + 8 * i).value for i in range(2))
            data = ctypes.c_void_p.from_address(base + 248).value
            if ctypes.c_int32.from_address(base).value == 0 and data:  # f32
                arr = np.ctypeslib.as_array((ctypes.c_float * (ne0 * ne1)).from_address(data))
                rows[name_] = arr[-ne0:].copy()
            return True
        cbf = llama_cpp.ggml_backend_sched_eval_callback(cb)
        mdl = llama_cpp.llama_model_load_from_file(path.encode(),
                                                   llama_cpp.llama_model_default_params())
        cp = llama_cpp.llama_context_default_params()
        cp.n_ctx, cp.n_batch, cp.n_ubatch = spec["n_ctx"], nb, nb
        cp.type_k = cp.type_v = 1  # f16 KV
        cp.flash_attn_type = 0
        cp.n_threads = cp.n_threads_batch = spec["threads"]
        cp.cb_eval = cbf
        ctx = llama_cpp.llama_init_from_model(mdl, cp)
        for i in range(0, len(ids), nb):
            chunk = ids[i:i + nb]
            arr = (llama_cpp.llama_token * len(chunk))(*chunk)
            assert llama_cpp.llama_decode(ctx, llama_cpp.llama_batch_get_one(arr, len(chunk))) == 0
        res.update({f"{name}.{k}": v for k, v in rows.items()})
        llama_cpp.llama_free(ctx)
        llama_cpp.llama_model_free(mdl)
    np.savez(out, **res)
    """
)


def prompt_ids(model: Any) -> list[tuple[str, str, list[int]]]:
    """(name, text, ids) of each prompt; a chat one rendered by the model's template."""
    out = []
    for name, text in PROMPTS:
        if text.startswith("chat:"):
            text = model.render_chat([{"role": "user", "content": text[len("chat:"):]}])
        out.append((name, text, model.tokenizer.encode_prompt(text)))
    return out


def llama_runs(ref_python: str, path: Path, prompts: list[tuple[str, str, list[int]]],
               n: int, config: dict[str, int] | None = None) -> dict[str, np.ndarray]:
    """llama.cpp's greedy picks and every step's logits, per prompt (its own interpreter);
    config: Llama() arguments over the defaults (ALT_CONFIGS)."""
    return _reference(ref_python, LLAMA_SCRIPT, path, {
        "n_ctx": N_CTX, "threads": THREADS, "n": n,
        "prompts": [{"text": t, "ids": ids} for _, t, ids in prompts], "config": config or {}},
        "llama.cpp")


def _reference(ref_python: str, script: str, path: Path, spec: dict[str, object],
               what: str) -> dict[str, np.ndarray]:
    """Run `script` in llama.cpp's interpreter on the file with a JSON spec; its npz arrays."""
    with tempfile.TemporaryDirectory() as tmp:
        spec_file, out = Path(tmp) / "spec.json", Path(tmp) / "out.npz"
        spec_file.write_text(json.dumps(spec))
        proc = subprocess.run([ref_python, "-c", script, str(path), str(spec_file), str(out)],
                              capture_output=True, text=True, check=False, timeout=1800)
        if proc.returncode != 0:
            raise RuntimeError(f"{what} failed on {path}:\n{proc.stderr[-3000:]}")
        with np.load(out) as z:
            return {k: z[k] for k in z.files}


def top2(row: np.ndarray) -> list[tuple[int, float]]:
    i2 = np.argpartition(-row, 2)[:2]
    i2 = i2[np.argsort(-row[i2])]
    return [(int(i), float(row[i])) for i in i2]


def compare(engine: Any, ids: list[int], ref_logits: np.ndarray, ref_greedy: np.ndarray,
            near_tie: float) -> dict[str, Any]:
    """minfer's own greedy run against llama.cpp's, step by step while their contexts agree."""
    n = len(ref_greedy)
    logits = engine.forward(ids, 0, n_out=1)[-1]
    picks: list[int] = []
    drifts: list[float] = []  # max |M - L| over the vocabulary, and over L's top 10
    drifts10: list[float] = []
    res: dict[str, Any] = {"equal": n, "diverged": None}
    for step in range(n):
        ref = ref_logits[step]
        drifts.append(float(np.abs(logits - ref).max()))
        drifts10.append(top10_drift(logits, ref))
        pick = int(np.argmax(logits))
        picks.append(pick)
        if pick != int(ref_greedy[step]) and res["diverged"] is None:
            mt, lt = top2(logits), top2(ref)
            m_margin, l_margin = mt[0][1] - mt[1][1], lt[0][1] - lt[1][1]
            res.update(equal=step, diverged={
                "step": step, "minfer_top2": mt, "llama_top2": lt,
                "minfer_margin": m_margin, "llama_margin": l_margin,
                # each engine's logits of the two picks: L[a] - L[b] + M[b] - M[a]
                "minfer_on_picks": [float(logits[pick]), float(logits[lt[0][0]])],
                "llama_on_picks": [float(ref[pick]), float(ref[lt[0][0]])],
                "drift_before": max(drifts[:-1], default=0.0), "drift_at": drifts[-1],
                "drift10_before": max(drifts10[:-1], default=0.0), "drift10_at": drifts10[-1],
                "near_tie": max(m_margin, l_margin) < near_tie,
            })
            break  # past it the two engines decode different texts
        if step + 1 < n:
            logits = engine.forward([pick], len(ids) + step, n_out=1)[-1]
    res["drift"] = max(drifts)  # every step on a context the two engines share
    res["drift10"] = max(drifts10)
    res["minfer_ids"] = picks
    res["llama_ids"] = [int(t) for t in ref_greedy]
    return res


def top10_drift(a: np.ndarray, ref: np.ndarray) -> float:
    """max |a - ref| over ref's 10 largest logits (the dense references' measure)."""
    return float(np.abs(a - ref)[np.argpartition(-ref, 10)[:10]].max())


def yardstick(div: dict[str, Any], ref_python: str, path: Path, context: list[int],
              ref: np.ndarray) -> None:
    """llama.cpp's own spread at a divergence above the near-tie bound: the divergent step's
    logits in each of ALT_CONFIGS against its default's (ref), and the two picks' margin there
    (`within_llama` judges it)."""
    a, b = div["llama_top2"][0][0], div["minfer_top2"][0][0]
    alts = {}
    for name, config in ALT_CONFIGS.items():
        alt = llama_runs(ref_python, path, [("", "", context)], 1, config)["0.logits"][0]
        alts[name] = {"drift10": top10_drift(alt, ref), "drift": float(np.abs(alt - ref).max()),
                      "margin": float(alt[a] - alt[b])}
    div["llama_alt"] = alts


def layer_spread(model: Any, ref_python: str, path: Path, context: list[int]
                 ) -> list[tuple[float, float]]:
    """Per layer, the last row's output (the residual stream) of minfer against llama.cpp's
    and, the yardstick, llama.cpp's with the prompt one token at a time against its own:
    rms(difference) / rms(llama.cpp's), on the divergent step's context."""
    from minfer.engine.trace import StepTracer

    engine = model.engine(N_CTX)
    engine.tracer = StepTracer(capture=True)
    engine.forward(context, 0)
    tracer, engine.tracer = engine.tracer, None
    step = tracer.steps[-1]
    graph = tracer.prepared[step.header["graph"]].graph
    mine = {graph.nodes[nid].meta.layer: np.asarray(out)[-1].ravel()
            for nid, out in step.outputs.items() if graph.nodes[nid].name == "ffn_resid"}
    ref = _reference(ref_python, LAYERS_SCRIPT, path,
                     {"n_ctx": N_CTX, "threads": THREADS, "ids": context}, "llama.cpp's layers")

    def rel(a: np.ndarray, b: np.ndarray) -> float:
        return float(np.sqrt(np.mean((a - b) ** 2) / np.mean(b.astype(np.float64) ** 2)))

    return [(rel(mine[il], ref[f"default.l_out-{il}"]),
             rel(ref[f"ubatch1.l_out-{il}"], ref[f"default.l_out-{il}"]))
            for il in range(len(mine))]


def run_file(path: Path, n: int, ref_python: str, near_tie: float,
             layers: bool = False) -> dict[str, Any]:
    import minfer

    model = minfer.load(path, n_ctx=N_CTX, kv_type="f16", threads=THREADS, backend="cpu")
    prompts = prompt_ids(model)
    ref = llama_runs(ref_python, path, prompts, n)
    engine = model.engine(N_CTX)
    rows = []
    for i, (name, _, ids) in enumerate(prompts):
        r = compare(engine, ids, ref[f"{i}.logits"], ref[f"{i}.greedy"], near_tie)
        r["prompt"] = name
        if r["diverged"] is not None and not r["diverged"]["near_tie"]:
            context = ids + r["llama_ids"][:r["equal"]]
            yardstick(r["diverged"], ref_python, path, context, ref[f"{i}.logits"][r["equal"]])
            if layers:
                r["diverged"]["layers"] = layer_spread(model, ref_python, path, context)
        r["tokenized_equal"] = ref[f"{i}.tokenized"].tolist() == ids
        r["minfer_text"] = model.tokenizer.decode(r["minfer_ids"])
        r["llama_text"] = model.tokenizer.decode(r["llama_ids"])
        rows.append(r)
    return {"file": str(path), "type": path.stem, "llama_cpp": str(ref["version"]),
            "prompts": rows}


def describe(result: dict[str, Any], n: int, near_tie: float) -> str:
    lines = []
    for r in result["prompts"]:
        d = r["diverged"]
        head = f"{result['type']:8s} {r['prompt']:6s}"
        if not r["tokenized_equal"]:
            head += " (llama.cpp tokenizes the text differently; minfer's ids fed to both)"
        if d is None:
            lines.append(f"{head} equal {n}/{n}, drift {r['drift']:.3f} (top-10 "
                         f"{r['drift10']:.3f})")
            continue
        kind = "near-tie" if d["near_tie"] else f"NOT a near-tie (< {near_tie}); " + ", ".join(
            f"llama.cpp {k}: drift {v['drift10']:.3f} ({v['drift']:.3f}), picks' margin "
            f"{v['margin']:.4f}" for k, v in d["llama_alt"].items()) + (
            ": within llama.cpp's own spread" if within_llama(d) else ": UNEXPLAINED")
        lines.append(
            f"{head} equal {r['equal']}/{n}, step {d['step']}: llama.cpp {d['llama_top2']} "
            f"margin {d['llama_margin']:.4f}, minfer {d['minfer_top2']} margin "
            f"{d['minfer_margin']:.4f}; drift before {d['drift_before']:.3f} (top-10 "
            f"{d['drift10_before']:.3f}), at {d['drift_at']:.3f} ({d['drift10_at']:.3f}): "
            f"{kind}\n    llama.cpp {r['llama_text']!r}\n"
            f"    minfer    {r['minfer_text']!r}")
        if "layers" in d:
            lines.append("    per layer, rms of the last row's difference / rms of llama.cpp's: "
                         "minfer, llama.cpp ubatch 1\n" + "\n".join(
                             f"    {il:3d} {m:.2e} {u:.2e}" for il, (m, u) in
                             enumerate(d["layers"])))
    return "\n".join(lines)


def within_llama(div: dict[str, Any]) -> bool:
    """minfer's top-10 drift at the divergent step of the order of llama.cpp's own there: at
    most SPREAD_FACTOR times the larger of its ALT_CONFIGS' (two samples of its spread only)."""
    return div["drift10_at"] <= SPREAD_FACTOR * max(v["drift10"]
                                                    for v in div["llama_alt"].values())


def verdict(div: dict[str, Any]) -> str:
    if div["near_tie"]:
        return ""
    spread = max(v["drift10"] for v in div["llama_alt"].values())
    return (f" (drift {div['drift10_at']:.2f}, llama.cpp's own {spread:.2f})"
            if within_llama(div) else
            f" (UNEXPLAINED: drift {div['drift10_at']:.2f}, llama.cpp's own {spread:.2f})")


def table(results: list[dict[str, Any]], n: int) -> str:
    """docs/performance.md's table: per type, prompts equal to n, first divergences, margins."""
    out = [f"| type | prompts equal to {n} | first divergence (prompt: step) | margins "
           "llama.cpp / minfer | drift, top-10 (vocab) |", "|---|---|---|---|---|"]
    for res in results:
        rows = res["prompts"]
        div = [r for r in rows if r["diverged"] is not None]
        first = ", ".join(f"{r['prompt']}: {r['diverged']['step']}" for r in div) or "-"
        margins = ", ".join(
            f"{r['diverged']['llama_margin']:.3f} / {r['diverged']['minfer_margin']:.3f}"
            + verdict(r["diverged"]) for r in div) or "-"
        drift = max(r["drift"] for r in rows)
        drift10 = max(r["drift10"] for r in rows)
        out.append(f"| {res['type']} | {len(rows) - len(div)}/{len(rows)} | {first} | "
                   f"{margins} | {drift10:.2f} ({drift:.2f}) |")
    return "\n".join(out)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("files", nargs="*", type=Path)
    ap.add_argument("--dir", type=Path, default=Path.home() / ".cache/minfer/qtypes-1.5b")
    ap.add_argument("--types", default="", help="comma-separated: <dir>/<TYPE>.gguf each")
    ap.add_argument("-n", type=int, default=32, help="greedy tokens per prompt")
    ap.add_argument("--near-tie", type=float, default=NEAR_TIE)
    ap.add_argument("--ref-python",
                    default=os.environ.get("MINFER_REF_PYTHON", "/tmp/refvenv/bin/python"))
    ap.add_argument("--json", type=Path, default=None, help="also write every run here")
    ap.add_argument("--layers", action="store_true",
                    help="at a divergence above the near-tie bound, also compare each layer's "
                    "output (minfer's and llama.cpp's one-token-at-a-time run against llama.cpp)")
    ap.add_argument("--table", type=Path, nargs="+", default=None,
                    help="print the table of these --json files (their runs in order) only")
    args = ap.parse_args()
    if args.table:
        runs = [json.loads(p.read_text()) for p in args.table]
        print(table([res for run in runs for res in run["results"]], runs[0]["n"]))
        return 0
    files = list(args.files) or (
        [args.dir / f"{t.strip()}.gguf" for t in args.types.split(",") if t.strip()]
        or sorted(p for p in args.dir.glob("*.gguf") if p.stem != "imatrix"))
    results = []
    for path in files:
        res = run_file(path, args.n, args.ref_python, args.near_tie, args.layers)
        results.append(res)
        print(describe(res, args.n, args.near_tie), flush=True)
        if args.json:  # after each file: a long run's finished files survive a stop
            args.json.write_text(json.dumps({"n": args.n, "near_tie": args.near_tie,
                                             "results": results}, indent=1))
    print()
    print(table(results, args.n))
    return 0


if __name__ == "__main__":
    sys.exit(main())
