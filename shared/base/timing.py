"""How long an inference engine takes: one timing model for the simulator and the engine stand-in.

The simulator (`dynamo_lite.simulate`) runs it on a simulated clock, the engine stand-in
(`dynamo_lite.mock_engine`) on the real one; both ask the same questions of it.

An engine step (vLLM's scheduler iteration) prefills some prompt tokens and decodes one token
for each running request; its duration is

    step_seconds = prefill_tokens * prefill_secs_per_token
                   + (decode_step_secs + decode_secs_per_running * decoding)   if decoding > 0

so prefill time grows with the uncached prompt (a cache hit shortens the time to first token)
and a decode step slows as the batch grows (load lengthens both TTFT and inter-token latency).

The defaults model Llama 3.1 8B in BF16 on one H100 SXM, derived from the datasheet's figures
(989 TFLOPS dense BF16, 3.35 TB/s HBM3) at the efficiencies vLLM reaches on it:

* prefill: 2 x 8.0e9 FLOPs per token at ~50 % of peak -> 32 us per token (1,000 tokens: 32 ms);
* decode: every step reads the 16 GB of weights at ~70 % of peak bandwidth -> 6.8 ms, plus the
  running requests' KV (128 KiB per token of context, ~500 tokens each on average) and their
  share of the compute -> ~0.06 ms per running request.

These land within vLLM's published single-H100 figures for 8B models (inter-token latency of
7-8 ms at low load, ~15 ms with a hundred requests running). They are flags of the engine
stand-in, so a user can fit them to their own measurements.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Final

PREFILL_SECS_PER_TOKEN: Final = 32e-6
DECODE_STEP_SECS: Final = 6.8e-3
DECODE_SECS_PER_RUNNING: Final = 0.06e-3


@dataclass(frozen=True, slots=True)
class TimingModel:
    """Seconds an engine spends on prefill and decode (see the module docstring)."""

    prefill_secs_per_token: float = PREFILL_SECS_PER_TOKEN
    decode_step_secs: float = DECODE_STEP_SECS
    decode_secs_per_running: float = DECODE_SECS_PER_RUNNING

    def __post_init__(self) -> None:
        for name in ("prefill_secs_per_token", "decode_step_secs", "decode_secs_per_running"):
            value = getattr(self, name)
            if not (value >= 0 and math.isfinite(value)):
                raise ValueError(f"{name} must be a finite number >= 0, not {value!r}")

    @classmethod
    def from_rates(cls, prefill_tps: float, decode_tps: float) -> TimingModel:
        """A model with fixed rates: `prefill_tps` prompt tokens per second, and `decode_tps`
        tokens per second for each running request whatever the batch (the simulator's model)."""
        return cls(prefill_secs_per_token=1.0 / prefill_tps, decode_step_secs=1.0 / decode_tps,
                   decode_secs_per_running=0.0)

    def prefill_seconds(self, uncached_tokens: int) -> float:
        """Time to compute `uncached_tokens` prompt tokens."""
        return uncached_tokens * self.prefill_secs_per_token

    def decode_step_seconds(self, running: int) -> float:
        """One decode step (one token for each of `running` requests); 0 with none running."""
        if running <= 0:
            return 0.0
        return self.decode_step_secs + self.decode_secs_per_running * (running - 1)

    def decode_seconds(self, output_tokens: int, running: int = 1) -> float:
        """`output_tokens` decode steps at a constant batch of `running` requests."""
        return output_tokens * self.decode_step_seconds(running)

    def step_seconds(self, prefill_tokens: int, decoding: int) -> float:
        """One engine step that prefills `prefill_tokens` and decodes for `decoding` requests."""
        return self.prefill_seconds(prefill_tokens) + self.decode_step_seconds(decoding)

    def scaled(self, speedup: float) -> TimingModel:
        """The same engine `speedup` times faster (Dynamo's mocker calls it `speedup_ratio`):
        tests and demos keep the shape of the timing at a fraction of the wall time."""
        if not (speedup > 0 and math.isfinite(speedup)):
            raise ValueError(f"speedup must be a positive number, not {speedup!r}")
        return TimingModel(self.prefill_secs_per_token / speedup, self.decode_step_secs / speedup,
                           self.decode_secs_per_running / speedup)


__all__ = ["DECODE_SECS_PER_RUNNING", "DECODE_STEP_SECS", "PREFILL_SECS_PER_TOKEN", "TimingModel"]
