"""minfer.sampling: logits -> token id (the sampler chain) and its settings.

`Sampler(params, n_vocab, seed=...)` with `.sample(logits)`, `.accept(id)`, `.reset(prompt)`;
`SamplerParams` carries llama.cpp's defaults; `LogitMask` is the hook for grammar constraints.
"""

from minfer.sampling.mask import AllowedTokens, LogitMask
from minfer.sampling.params import DEFAULT_DRY_BREAKERS, SamplerParams
from minfer.sampling.sampler import Sampler

__all__ = ["DEFAULT_DRY_BREAKERS", "AllowedTokens", "LogitMask", "Sampler", "SamplerParams"]
