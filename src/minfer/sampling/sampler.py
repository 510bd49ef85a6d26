"""The sampler chain: logits [n_vocab] -> one token id, in llama.cpp's order.

    logit mask (grammar) -> repetition/frequency/presence penalties -> DRY
        -> top-k -> typical-p -> top-p -> min-p -> temperature -> seeded draw
        |  temp <= 0: argmax after the penalty stages (greedy)
        |  mirostat 1/2: temperature -> mirostat (instead of top-k .. draw)

Penalties and DRY look at a token history: `reset(prompt)` seeds it with the prompt's tokens (each
stage keeps the tail it needs) and `accept(id)` appends each generated token. `sample` does not
accept on its own, so a caller may look at (or reject) the token first.

Determinism: the draw uses a numpy Generator seeded with `seed`; `reset` re-seeds it (as
llama.cpp's chain reset does), so a generation is a function of (seed, params, prompt, logits).
Pass `reset(..., seed=new)` to vary a regeneration.

Greedy: top-k, top-p and min-p never drop the argmax, so greedy skips them; it also skips
typical-p (which can), like llama.cpp's dedicated greedy sampler did.

Mirostat: llama.cpp's current chain runs only temperature before mirostat; minfer also runs the
mask, penalties and DRY first (older llama.cpp applied the penalties there too), so penalty flags
still act with --mirostat. With default settings (penalties and DRY off) the two agree.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from minfer.errors import SamplingError
from minfer.sampling import stages
from minfer.sampling.dry import DryPenalty, Encode, TokenText
from minfer.sampling.mask import LogitMask
from minfer.sampling.mirostat import Mirostat
from minfer.sampling.params import SamplerParams
from minfer.sampling.penalties import RepetitionPenalty


class Sampler:
    """One generation's sampler: settings, history (penalties, DRY, mirostat mu) and the RNG."""

    def __init__(
        self,
        params: SamplerParams,
        n_vocab: int,
        *,
        seed: int | None = None,
        token_text: TokenText | None = None,
        encode: Encode | None = None,
        logit_mask: LogitMask | None = None,
        n_ctx: int | None = None,
    ) -> None:
        """Build the chain.

        seed: draw seed (None: fresh OS entropy; read it back from `.seed`).
        token_text: id -> text (or a list of texts); needed only when DRY is on.
        encode: text -> ids; needed only for multi-character DRY breakers.
        logit_mask: a constraint applied first (see minfer.sampling.mask).
        n_ctx: the context size, which penalty_last_n = -1 / dry_penalty_last_n = -1 mean.
        """
        if isinstance(n_vocab, bool) or not isinstance(n_vocab, int) or n_vocab <= 0:
            raise SamplingError(f"n_vocab must be a positive integer, got {n_vocab!r}")
        self.params = params
        self.n_vocab = n_vocab
        self.logit_mask = logit_mask
        self.seed = _check_seed(seed)
        self._rng = np.random.default_rng(self.seed)
        self._all_ids = np.arange(n_vocab, dtype=np.int64)

        last_n = params.penalty_last_n
        if last_n < 0 and n_ctx is not None:
            last_n = n_ctx
        self.penalties = RepetitionPenalty(
            last_n=last_n,
            repeat=params.repeat_penalty,
            frequency=params.frequency_penalty,
            presence=params.presence_penalty,
        )
        self.dry = DryPenalty(
            multiplier=params.dry_multiplier,
            base=params.dry_base,
            allowed_length=params.dry_allowed_length,
            last_n=params.dry_penalty_last_n,
            breakers=params.dry_sequence_breakers,
            n_vocab=n_vocab,
            n_ctx=n_ctx,
            token_text=token_text,
            encode=encode,
        )
        self.mirostat: Mirostat | None = None
        if params.mirostat:
            self.mirostat = Mirostat(
                version=params.mirostat,
                tau=params.mirostat_tau,
                eta=params.mirostat_eta,
                n_vocab=n_vocab,
            )

    def reset(self, prompt_tail: Sequence[int] = (), *, seed: int | None = None) -> None:
        """Start a generation: history := prompt_tail (oldest first), mu and RNG re-seeded."""
        if seed is not None:
            self.seed = _check_seed(seed)
        self._rng = np.random.default_rng(self.seed)
        tail = [self._check_id(t) for t in prompt_tail]
        self.penalties.reset(tail)
        self.dry.reset(tail)
        if self.mirostat is not None:
            self.mirostat.reset()
        if self.logit_mask is not None:
            self.logit_mask.reset()

    def accept(self, token_id: int) -> None:
        """Record a token the caller committed (penalty/DRY history, the mask's state)."""
        tok = self._check_id(token_id)
        self.penalties.accept(tok)
        self.dry.accept(tok)
        if self.logit_mask is not None:
            self.logit_mask.accept(tok)

    def sample(self, logits: np.ndarray) -> int:
        """Run the chain on logits [n_vocab] (not modified) and return the chosen token id."""
        p = self.params
        if (p.temp <= 0.0 and self.mirostat is None and self.logit_mask is None
                and not self.penalties.enabled and not self.dry.enabled):
            x = self._checked(logits)  # plain greedy: nothing writes, so no copy
        else:
            x = np.array(self._checked(logits), dtype=np.float32, copy=True)
        if self.logit_mask is not None:
            self.logit_mask.apply(x)
        self.penalties.apply(x)
        self.dry.apply(x)
        best = x.max()  # NaN anywhere propagates here
        if not best > -np.inf:
            raise SamplingError(f"cannot pick a token: the best logit is {best} (all masked?)")
        if p.temp <= 0.0 and self.mirostat is None:
            return int(np.argmax(x))
        c = stages.Candidates(self._all_ids, x)
        if self.mirostat is not None:
            return self.mirostat.sample(stages.temperature(c, p.temp), self._rng)
        c = self._truncated(c)
        i, _ = stages.draw(c, self._rng)
        return int(c.ids[i])

    def _truncated(self, c: stages.Candidates) -> stages.Candidates:
        p = self.params
        c = stages.top_k(c, p.top_k)
        c = stages.typical(c, p.typical_p, p.min_keep)
        c = stages.top_p(c, p.top_p, p.min_keep)
        c = stages.min_p(c, p.min_p, p.min_keep)
        return stages.temperature(c, p.temp)

    # -- what speculative decoding needs: the distribution `sample` draws from ------------------
    @property
    def greedy(self) -> bool:
        """`sample` is a deterministic argmax (temp <= 0, no mirostat)."""
        return self.params.temp <= 0.0 and self.mirostat is None

    def distribution(self, logits: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(candidate ids, probabilities summing to 1): the distribution `sample(logits)` draws
        from in the current state (mask, penalty history). Greedy: a point mass. Mirostat's
        distribution depends on its draw (mu), so it has none: SamplingError."""
        if self.mirostat is not None:
            raise SamplingError("mirostat has no fixed distribution to verify proposals against")
        x = np.array(self._checked(logits), dtype=np.float32, copy=True)
        if self.logit_mask is not None:
            self.logit_mask.apply(x)
        self.penalties.apply(x)
        self.dry.apply(x)
        if not x.max() > -np.inf:
            raise SamplingError(f"cannot pick a token: the best logit is {x.max()} (all masked?)")
        if self.params.temp <= 0.0:
            return np.array([int(np.argmax(x))], np.int64), np.ones(1)
        c = self._truncated(stages.Candidates(self._all_ids, x))
        return c.ids, stages.softmax(c.logits)

    def random(self) -> float:
        """One uniform draw in [0, 1) from this sampler's seeded generator."""
        return float(self._rng.random())

    def choose(self, weights: np.ndarray) -> int:
        """Draw an index with probability proportional to `weights` [n] (non-negative, n_vocab
        or fewer entries), from this sampler's seeded generator."""
        i, total = stages.inverse_cdf(np.asarray(weights, dtype=np.float64), self.random())
        if not total > 0:
            raise SamplingError("cannot draw from an all-zero distribution")
        return i

    def _checked(self, logits: np.ndarray) -> np.ndarray:
        if not isinstance(logits, np.ndarray) or logits.shape != (self.n_vocab,):
            shape = getattr(logits, "shape", type(logits).__name__)
            raise SamplingError(f"logits must be an array of shape ({self.n_vocab},), got {shape}")
        return np.asarray(logits, dtype=np.float32)

    def _check_id(self, token_id: int) -> int:
        tok = int(token_id)
        if not 0 <= tok < self.n_vocab:
            raise SamplingError(f"token id {tok} outside the vocabulary (n_vocab={self.n_vocab})")
        return tok


def _check_seed(seed: int | None) -> int:
    if seed is None:
        return int(np.random.SeedSequence().entropy % (1 << 32))  # type: ignore[operator]
    if isinstance(seed, bool) or not isinstance(seed, int | np.integer) or seed < 0:
        raise SamplingError(f"seed must be a non-negative integer, got {seed!r}")
    return int(seed)
