"""The scenario list, by name, and running them."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from kvspec.fuzz.commands.e2e import checks
from kvspec.fuzz.commands.e2e.batch import scenario_batch
from kvspec.fuzz.commands.e2e.checks import SHORT, Divergence, Size, Tally
from kvspec.fuzz.commands.e2e.greedy import scenario_bf16_models, scenario_greedy
from kvspec.fuzz.commands.e2e.hybrid import (
    scenario_hybrid_mlx_lm,
    scenario_hybrid_prompt_reuse,
    scenario_hybrid_speculative,
)
from kvspec.fuzz.commands.e2e.models import Factories
from kvspec.fuzz.commands.e2e.quantized import scenario_quantized_models
from kvspec.fuzz.commands.e2e.snapshots import (
    scenario_lru_prompt_cache,
    scenario_prefix_sharing,
    scenario_prompt_reuse,
)
from kvspec.fuzz.commands.e2e.speculative import (
    scenario_speculative,
    scenario_speculative_drift,
    scenario_speculative_window,
)
from kvspec.fuzz.commands.e2e.turbo import scenario_turbo
from kvspec.fuzz.commands.e2e.windows import scenario_mixed_rollback, scenario_sliding_window


@dataclass(frozen=True)
class Scenario:
    name: str
    title: str
    run: Callable[..., tuple[Tally, float | None]]
    #: why the scenario's reference does not hold on a GPU ("" when it does):
    #: it compares, bit for bit, outputs that a GPU computes with kernels of
    #: different shapes (GPU matmul and attention round by shape; measured on
    #: MLX 0.32 CUDA: log-probabilities 1 to 2 bfloat16 ulps apart with any
    #: cache, mlx-lm's own included), or it needs a kernel MLX's CUDA backend
    #: does not have
    cpu_only: str = ""


SCENARIOS: list[Scenario] = [
    Scenario("greedy", "1 greedy", scenario_greedy),
    Scenario("speculative", "2 speculative", scenario_speculative),
    Scenario("prompt_reuse", "3 prompt_reuse", scenario_prompt_reuse),
    Scenario("sliding_window", "4 sliding_window", scenario_sliding_window),
    Scenario("mixed_rollback", "5 mixed_rollback", scenario_mixed_rollback),
    Scenario("lru_prompt_cache", "6 lru_prompt_cache", scenario_lru_prompt_cache),
    Scenario("prefix_sharing", "7 prefix_sharing", scenario_prefix_sharing,
             "compares a batch of forked sequences with each sequence alone, bit for bit"),
    Scenario("speculative_window", "8 speculative_window", scenario_speculative_window,
             "compares a verify block's logits with one-row steps', bit for bit"),
    Scenario("bf16_models", "9 bf16_models", scenario_bf16_models),
    Scenario("turbo", "10 turbo", scenario_turbo, "compares speculative (k-row verify) with greedy decoding, bit for bit"),
    Scenario("speculative_drift", "11 speculative_drift", scenario_speculative_drift),
    Scenario("quantized_models", "12 quantized_models", scenario_quantized_models,
             "kv_bits=4 runs mlx-lm's QuantizedKVCache, whose quantized matmul MLX 0.32's CUDA backend lacks "
             "for the tiny models' head dims (on the H200: 'No implementation for problem shape: 1x7x32x4')"),
    Scenario("batch", "13 batch", scenario_batch),
    Scenario("hybrid_speculative", "14 hybrid_speculative", scenario_hybrid_speculative,
             "compares a verify block's log-probabilities with one-token steps', bit for bit"),
    Scenario("hybrid_prompt_reuse", "15 hybrid_prompt_reuse", scenario_hybrid_prompt_reuse,
             "compares a trimmed prefill call's recurrent states with a run of other call sizes, bit for bit; "
             "on the GPU a float32 matmul row depends on the rows in its call (on the H200: up to 1.9e-5 between "
             "a 12-row call and one-row calls), so the states before any rollback already differ in bits"),
    Scenario("hybrid_mlx_lm", "16 hybrid_mlx_lm", scenario_hybrid_mlx_lm),
]


def gpu_skipped(names: list[str] | None = None) -> list[tuple[str, str]]:
    """(name, reason) of the scenarios that do not run on this device."""
    if not checks.on_gpu():
        return []
    return [(s.name, s.cpu_only) for s in SCENARIOS if s.cpu_only and (names is None or s.name in names)]


@dataclass
class ScenarioResult:
    name: str
    title: str
    ok: bool
    tokens: int
    distinct: int
    acceptance: float | None
    seconds: float
    detail: str

    def to_json(self) -> dict[str, Any]:
        return {
            "scenario": self.name, "ok": self.ok, "tokens": self.tokens, "distinct": self.distinct,
            "acceptance": None if self.acceptance is None else round(self.acceptance, 3),
            "seconds": round(self.seconds, 2), "detail": self.detail,
        }


def by_name(name: str) -> Scenario:
    for s in SCENARIOS:
        if s.name == name:
            return s
    import difflib

    close = difflib.get_close_matches(name, [s.name for s in SCENARIOS], n=1)
    hint = f" (did you mean {close[0]!r}?)" if close else ""
    raise KeyError(f"no e2e scenario named {name!r}{hint}; known: {[s.name for s in SCENARIOS]}")


def run_scenario(name: str, size: Size = SHORT, factories: Factories = None, **kwargs: Any) -> ScenarioResult:
    """Run one scenario; a failed check (Divergence) or any exception is a
    failed result whose detail says what differed."""
    scenario = by_name(name)
    start = time.perf_counter()
    try:
        tally, acceptance = scenario.run(size, factories, **kwargs)
        ok, detail = True, "; ".join(tally.checks)
    except Divergence as exc:
        tally, acceptance, ok, detail = Tally(), None, False, str(exc)
    except Exception as exc:  # noqa: BLE001 - a broken cache may raise anywhere inside the model
        tally, acceptance, ok, detail = Tally(), None, False, f"{type(exc).__name__}: {exc}"
    return ScenarioResult(scenario.name, scenario.title, ok, len(tally.tokens), len(set(tally.tokens)),
                          acceptance, time.perf_counter() - start, detail)


def run_all(size: Size = SHORT, factories: Factories = None, names: list[str] | None = None,
            progress: Callable[[ScenarioResult], None] | None = None) -> list[ScenarioResult]:
    """Run the scenarios (``names``: only these); ``progress(result)`` after each."""
    out = []
    skip = {name for name, _ in gpu_skipped()}
    for s in SCENARIOS:
        if (names is None or s.name in names) and s.name not in skip:
            out.append(run_scenario(s.name, size, factories))
            if progress is not None:
                progress(out[-1])
    return out
