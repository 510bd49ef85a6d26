"""One parallel region per run of op-tape steps (issue #66).

    sync        atomics, the spin-then-yield barrier's pieces, indirect calls (LLVM intrinsics)
    runtime     the region: every thread walks the same steps, barriers between dependent ones
    adapters    a C-callable form of each kernel the region runs, generated per argument types
    parts       `share(part, n_parts, n)`: a thread's (start, stop) of a step's n items

`minfer.backends.cpu.regions` groups a bound tape's steps into regions.
"""
