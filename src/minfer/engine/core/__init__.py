"""minfer.engine.core: the one generation core (vLLM v1's EngineCore) that every surface runs on.

    scheduler.py  continuous batching: who feeds which tokens each step, the slot prompt cache
    runner.py     a Plan → one forward (`Runner`: a multi-slot Batch; `SequenceRunner`: one slot)
    request.py    one request's draws, limits, logprobs, timings and record (`Request`)
    proposer.py   speculation: prompt lookup and the draft model, batched across slots
    lookup.py     prompt lookup's guesses: an n-gram's continuation, a copy followed through edits
    policy.py     speculation's policy: whether and how many tokens to propose (DraftLength,
                  StepCost, BatchPayoff), what a proposal is, a draft's stopping rule
    core.py       `EngineCore`: add / abort / step (schedule → propose → forward → draw)
"""
