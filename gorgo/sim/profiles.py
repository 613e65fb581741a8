"""Engine performance profiles: the constants of the simulated engines' step-time model.

One batch step of a continuous-batching engine costs

    step_ms = c0 + c_prefill * prefill_tokens + c_decode * running + c_attn * context_tokens / 1000

``c0`` is the fixed cost of a forward pass (reading the weights once, kernel launches, sampling);
``c_prefill`` the marginal cost of one prompt token in the batch (compute-bound GEMMs);
``c_decode`` the marginal cost of one more decoding sequence; ``c_attn`` the cost of reading 1k
tokens of KV cache (memory-bound attention of the decoding batch). The sources of each constant
are in docs/simulator.md; ``describe`` turns a profile into the TTFT/ITL it produces.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from gorgo.core.fleet import SimEngineSpec
from gorgo.core.tokens import Tokenization


@dataclass(frozen=True, slots=True)
class EngineProfile:
    """Step-time constants and scheduler limits of one (model, GPU, engine) combination."""

    name: str
    c0_ms: float
    c_prefill_ms_per_token: float
    c_decode_ms_per_seq: float
    c_attn_ms_per_ktoken: float
    max_running: int
    kv_capacity_tokens: int
    prefill_chunk_tokens: int
    max_queue: int

    def __post_init__(self) -> None:
        for field in ("c0_ms", "c_prefill_ms_per_token", "c_decode_ms_per_seq",
                      "c_attn_ms_per_ktoken"):
            if getattr(self, field) < 0:
                raise ValueError(f"{self.name}: {field} must be >= 0")
        for field in ("max_running", "kv_capacity_tokens", "prefill_chunk_tokens"):
            if getattr(self, field) < 1:
                raise ValueError(f"{self.name}: {field} must be >= 1")
        if self.max_queue < 0:
            raise ValueError(f"{self.name}: max_queue must be >= 0")

    def step_time_s(self, prefill_tokens: int, running: int, context_tokens: int) -> float:
        """Seconds one batch step takes (before the engine's speed factor)."""
        return (
            self.c0_ms
            + self.c_prefill_ms_per_token * prefill_tokens
            + self.c_decode_ms_per_seq * running
            + self.c_attn_ms_per_ktoken * context_tokens / 1000.0
        ) / 1000.0


PROFILES: dict[str, EngineProfile] = {
    p.name: p
    for p in (
        # Llama-3.1-8B-Instruct bf16 on one H100-80GB under SGLang/vLLM.
        EngineProfile(
            name="h100-llama3-8b",
            c0_ms=6.0,
            c_prefill_ms_per_token=0.05,
            c_decode_ms_per_seq=0.03,
            c_attn_ms_per_ktoken=0.04,
            max_running=256,
            kv_capacity_tokens=400_000,
            prefill_chunk_tokens=8192,
            max_queue=1024,
        ),
        # Qwen3.5-35B-A3B-FP8, tensor parallel over two L40S-48GB, SGLang (GORGO paper's fleet).
        EngineProfile(
            name="2xl40s-qwen3.5-35b-a3b-fp8",
            c0_ms=7.0,
            c_prefill_ms_per_token=0.09,
            c_decode_ms_per_seq=0.06,
            c_attn_ms_per_ktoken=0.015,
            max_running=64,
            kv_capacity_tokens=1_400_000,
            prefill_chunk_tokens=4096,
            max_queue=1024,
        ),
        # Small and quick, with limits low enough for tests to hit them.
        EngineProfile(
            name="tiny-test",
            c0_ms=1.0,
            c_prefill_ms_per_token=0.01,
            c_decode_ms_per_seq=0.1,
            c_attn_ms_per_ktoken=0.1,
            max_running=4,
            kv_capacity_tokens=2048,
            prefill_chunk_tokens=256,
            max_queue=4,
        ),
    )
}


def get_profile(name: str) -> EngineProfile:
    try:
        return PROFILES[name]
    except KeyError:
        known = ", ".join(sorted(PROFILES))
        raise ValueError(f"unknown engine profile {name!r} (known: {known})") from None


def replica_profile(sim: SimEngineSpec) -> EngineProfile:
    """A simulated replica's profile, with its ``sim.kv_tokens`` pool when it sets one."""
    profile = get_profile(sim.profile)
    return replace(profile, kv_capacity_tokens=sim.kv_tokens) if sim.kv_tokens else profile


@dataclass(frozen=True, slots=True)
class ProfileRow:
    """What one prompt size costs on an otherwise idle engine (milliseconds)."""

    prompt_tokens: int
    ttft_ms: float  # cold prompt, nothing cached
    ttft_half_cached_ms: float  # first half of the prompt served from the prefix cache
    itl_ms: float  # decode step of this request alone
    batch: int  # decoding requests of this size in the batched ITL column (0: does not fit)
    itl_batch_ms: float  # decode step with ``batch`` such requests running


DESCRIBE_PROMPTS = (1024, 8192, 32768)
DESCRIBE_BATCH = 32


def describe(
    profile: EngineProfile,
    prompts: tuple[int, ...] = DESCRIBE_PROMPTS,
    batch: int = DESCRIBE_BATCH,
    tokenization: Tokenization | None = None,
) -> list[ProfileRow]:
    """TTFT and ITL the profile produces, measured by driving the engine model itself."""
    from gorgo.sim.engine import idle_latencies  # engine imports this module

    tok = tokenization or Tokenization()
    rows = []
    for n in prompts:
        if n + 2 > profile.kv_capacity_tokens:
            continue
        ttft, itl = idle_latencies(profile, tok, n, cached_tokens=0)
        half, _ = idle_latencies(profile, tok, n, cached_tokens=n // 2)
        b = min(batch, profile.max_running, profile.kv_capacity_tokens // (n + 2))
        ctx = b * (n + 1)
        itl_b = profile.step_time_s(0, b, ctx) * 1000.0 if b else 0.0
        rows.append(ProfileRow(n, ttft * 1000.0, half * 1000.0, itl * 1000.0, b, itl_b))
    return rows


def format_rows(profile: EngineProfile, rows: list[ProfileRow]) -> str:
    """A Markdown table of ``describe``'s rows."""
    lines = [
        f"{profile.name}:",
        "",
        "| prompt tokens | TTFT cold (ms) | TTFT half cached (ms) | ITL alone (ms) "
        "| ITL batch (ms) |",
        "|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        batch = f"{r.itl_batch_ms:.1f} (x{r.batch})" if r.batch else "n/a"
        lines.append(
            f"| {r.prompt_tokens} | {r.ttft_ms:.0f} | {r.ttft_half_cached_ms:.0f} "
            f"| {r.itl_ms:.2f} | {batch} |"
        )
    return "\n".join(lines)


def main() -> None:
    for profile in PROFILES.values():
        print(format_rows(profile, describe(profile)))
        print()


if __name__ == "__main__":
    main()
