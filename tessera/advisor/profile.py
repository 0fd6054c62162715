"""`tessera profile`: the six measurements of a workload, each cheap.

1. memory: weight bytes per quantization mode, KV bytes per token, KV tokens that fit, and the
   concurrency and KV the trace needs (the scheduler simulation, fed with measured step times);
2. prefix structure: the trace's token ids replayed through KVCacheManager's own block hashing
   (no model), giving the prefix-cache hit rate by tokens and its curve over the pool size;
3. heterogeneity: length distributions and the token slots static batching would pad;
4. fragmentation: KV a contiguous reservation per request would hold against the paged cache,
   over the simulated run;
5. latency: n-gram (prompt lookup) acceptance replayed on the known outputs, and the speedup
   it would give at the trace's batch sizes under the step cost model;
6. scale: arrival rate and burstiness, prefill and decode shares of the time, and the simulated
   goodput of two colocated engines against one prefill and one decode worker.

Only step-time measurement runs the model (one engine, a few prefill and decode steps, cached
per model, dtype, thread count and torch version).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import random
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from tessera.advisor.sim import (
    SimRequest,
    SimResult,
    StepCosts,
    coefficient_of_variation,
    next_arrival_gaps,
    percentile,
    simulate,
    simulate_disaggregated,
    simulate_replicas,
)
from tessera.advisor.trace import TraceRequest, prompt_token_ids
from tessera.config import EngineConfig, ModelConfig, resolve_dtype

logger = logging.getLogger("tessera.advisor")

DEFAULT_SLO_TTFT_MS = 2000.0
DEFAULT_SLO_ITL_MS = 100.0
UNLIMITED_SEQS = 4096
# Bytes per linear-layer weight of each quantization mode, for the memory estimate when a mode
# was not measured (scales included); embeddings, norms and the lm_head stay at the dtype.
_BYTES_PER_WEIGHT = {"int8": 1.0 + 4 / 128, "w8a8": 1.0 + 4 / 128, "int4": 0.5 + 4 / 64, "gguf": 0.5 + 4 / 32}
# Host to device (or between hosts) KV transfer for the disaggregation estimate, bytes/s.
DEFAULT_TRANSFER_BYTES_PER_S = 10e9


# ---- what this build can switch ------------------------------------------------------------------


def engine_fields() -> set[str]:
    return {f.name for f in dataclasses.fields(EngineConfig)}


def quantization_modes(model_path: Path | None = None) -> list[str]:
    """Weight quantization modes this build offers for the model ("none" always first); gguf
    (compute from the file's own blocks) only for a .gguf model."""
    if "quantization" not in engine_fields():
        return ["none"]
    import tessera.config as config

    modes = getattr(config, "QUANTIZATION_METHODS", ("none",))
    is_gguf = model_path is not None and str(model_path).endswith(".gguf")
    return ["none", *(m for m in modes if m not in (None, "none") and (m != "gguf" or is_gguf))]


def speculative_fields() -> dict[str, str]:
    """Which EngineConfig fields hold the speculative method and the number of draft tokens."""
    names = engine_fields()
    method = next((n for n in ("speculative_method", "speculative_model", "spec_method") if n in names), None)
    k = next((n for n in ("num_speculative_tokens", "speculative_k", "spec_k") if n in names), None)
    return {"method": method, "k": k} if method and k else {}


# ---- the model and its step times ----------------------------------------------------------------


@dataclass
class ModelInfo:
    name: str
    config: ModelConfig
    dtype: torch.dtype
    max_model_len: int
    path: Path

    @property
    def element_size(self) -> int:
        return torch.empty((), dtype=self.dtype).element_size()

    def num_linear_params(self) -> int:
        """Weights of the decoder layers' linear projections (what weight quantization replaces)."""
        c = self.config
        q, kv = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
        return c.num_layers * (c.hidden_size * (q + 2 * kv) + q * c.hidden_size + 3 * c.hidden_size * c.intermediate_size)

    def num_params(self) -> int:
        c = self.config
        q, kv = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
        other = c.num_layers * (2 * c.hidden_size + ((q + 2 * kv) if c.attention_bias else 0))
        embed = c.vocab_size * c.hidden_size
        return embed * (1 if c.tie_word_embeddings else 2) + self.num_linear_params() + other + c.hidden_size

    def weight_bytes(self, mode: str = "none") -> int:
        """Estimated bytes of the weights under a quantization mode (the lm_head left at the dtype)."""
        n, linear = self.num_params(), self.num_linear_params()
        per = _BYTES_PER_WEIGHT.get(mode)
        if mode == "none" or per is None:
            return n * self.element_size
        return int((n - linear) * self.element_size + linear * per)

    def kv_bytes_per_token(self, kv_cache_dtype: str = "auto") -> int:
        """Bytes of K and V one token takes, as the engine allocates them (tessera/quant/kv.py)."""
        from tessera.quant.kv import kv_bytes_per_token

        return kv_bytes_per_token(self.config, self.dtype, kv_cache_dtype)


def load_model_info(model: str, dtype: str = "auto", max_model_len: int | None = None) -> ModelInfo:
    from tessera.model.download import resolve_model_path
    from tessera.model.weights import load_model_files

    path = resolve_model_path(model)
    mc = load_model_files(path).config
    mml = min(max_model_len or mc.max_position_embeddings, mc.max_position_embeddings)
    return ModelInfo(model, mc, resolve_dtype(dtype), mml, path)


def _costs_cache_file() -> Path:
    from tessera.model.download import cache_dir

    return cache_dir() / "advisor" / "step_costs.json"


def _kernels_tag() -> str:
    """A digest of the C++ kernel sources and whether they are on: new kernels make every step
    faster or slower, so costs measured with other kernels are stale."""
    import hashlib

    from tessera import native

    digest = hashlib.sha256(str(native.enabled()).encode())
    for source in sorted(Path(__file__).resolve().parent.parent.rglob("*.cpp")):
        digest.update(source.read_bytes())
    return digest.hexdigest()[:10]


# The OpenMP settings that change what a step costs: with OMP_WAIT_POLICY=PASSIVE a bf16 decode
# step of the default model took twice as long (47 against 24 ms, Xeon model 167, session 14).
_OMP_ENV = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "KMP_BLOCKTIME")


def _cache_key(info: ModelInfo, num_threads: int | None, quantization: str) -> str:
    st = info.path.stat()
    threads = num_threads or torch.get_num_threads()
    omp = ",".join(f"{k}={os.environ[k]}" for k in _OMP_ENV if k in os.environ)
    return (f"v4|{info.path.resolve()}|{st.st_size}|{int(st.st_mtime)}|{info.dtype}|{threads}|{torch.__version__}"
            f"|{quantization}|{_kernels_tag()}" + (f"|{omp}" if omp else ""))


def _read_cache() -> dict:
    try:
        return json.loads(_costs_cache_file().read_text())
    except (OSError, ValueError):
        return {}


def _write_cache(entries: dict[str, StepCosts]) -> None:
    cache_file = _costs_cache_file()
    cache = _read_cache()
    cache.update({k: dataclasses.asdict(v) for k, v in entries.items()})
    try:
        cache_file.parent.mkdir(parents=True, exist_ok=True)
        tmp = cache_file.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(cache, indent=1))
        tmp.replace(cache_file)
    except OSError as exc:
        logger.warning("could not cache step costs in %s: %s", cache_file, exc)


def measure_step_costs(info: ModelInfo, dtype: str = "auto", num_threads: int | None = None,
                       use_cache: bool = True, quantization: str = "none") -> StepCosts:
    """Time prefill chunks and decode steps of the real engine, fit the step cost model, cache it."""
    return measure_costs_by_mode(info, [quantization], dtype, num_threads, use_cache, rounds=1)[quantization]


def cached_step_costs(engine) -> StepCosts | None:
    """The step costs `tessera profile` / `advise` measured and cached for this engine's model,
    dtype, threads, quantization, kernels and OpenMP settings, or None: a lookup, never a probe
    (a probe builds a second engine, and beside a large model's weights that does not fit)."""
    info = ModelInfo(engine.config.model, engine.model_config, engine.dtype,
                     engine.config.max_model_len or engine.model_config.max_position_embeddings, engine.model_path)
    entry = _read_cache().get(_cache_key(info, engine.config.num_threads, engine.config.quantization))
    return StepCosts(**entry) if entry else None


def measure_costs_by_mode(info: ModelInfo, modes: list[str], dtype: str = "auto", num_threads: int | None = None,
                          use_cache: bool = True, rounds: int = 2) -> dict[str, StepCosts]:
    """Step costs of each quantization mode, timed in alternation over `rounds` rounds: each raw
    timing is the smallest seen, then the model is fitted once. On a shared machine, load that
    comes and goes then falls on every mode alike rather than on whichever was being timed at
    that moment. Cached per model, dtype, threads, torch version and mode."""
    keys = {mode: _cache_key(info, num_threads, mode) for mode in modes}
    cache = _read_cache() if use_cache else {}
    if all(k in cache for k in keys.values()):
        return {mode: StepCosts(**cache[k]) for mode, k in keys.items()}
    raw: dict[str, dict] = {}
    for _ in range(rounds):
        for mode in modes:
            t = _time_steps(info, dtype, num_threads, mode)
            raw[mode] = t if mode not in raw else {k: (min(v, t[k]) if isinstance(v, float) else
                                                       [min(x, y) for x, y in zip(v, t[k], strict=True)]
                                                       if isinstance(v, list) else v) for k, v in raw[mode].items()}
    costs = {mode: _fit_costs(info, mode, raw[mode]) for mode in modes}
    if use_cache:
        _write_cache({keys[m]: c for m, c in costs.items()})
    return costs


_CHUNK, _CHUNKS = 128, 4  # the attention probe: a prompt of 4 chunks of 128, one per step


def _time_steps(info: ModelInfo, dtype: str, num_threads: int | None, quantization: str = "none") -> dict:
    """Raw step timings on the real engine: decode steps of 1 and `batch` short sequences, and
    each step of one prompt prefilled in chunks (every chunk attends to more cached keys)."""
    from tessera.engine.engine import LLMEngine
    from tessera.sampling import SamplingParams

    batch, reps = 16, 5
    chunk = min(_CHUNK, (info.max_model_len - 2) // _CHUNKS)
    kv_tokens = batch * (reps + 16) + chunk * _CHUNKS + 64
    quant = {"quantization": quantization} if quantization != "none" else {}
    engine = LLMEngine(EngineConfig(
        model=str(info.path), dtype=dtype, num_threads=num_threads, enable_prefix_caching=False,
        max_num_batched_tokens=max(chunk, batch * 8), max_num_seqs=batch,
        max_model_len=min(info.max_model_len, chunk * _CHUNKS + 64),
        kv_cache_memory=kv_tokens * info.kv_bytes_per_token() + (1 << 16), **quant,
    ))
    rng = random.Random(0)
    vocab = info.config.vocab_size
    ids = iter(range(1 << 30))

    def prompt(n: int) -> list[int]:
        return [rng.randrange(min(100, vocab // 8), vocab - 1) for _ in range(n)]

    def timed_step() -> float:
        t = time.perf_counter()
        engine.step()
        return time.perf_counter() - t

    def chunked_prefill() -> list[float]:
        engine.scheduler.max_num_batched_tokens = chunk
        engine.add_request(f"prefill-{next(ids)}", prompt(chunk * _CHUNKS), SamplingParams(max_tokens=1,
                                                                                          ignore_eos=True))
        times = [timed_step() for _ in range(_CHUNKS)]
        while engine.has_unfinished_requests():
            engine.step()
        engine.scheduler.max_num_batched_tokens = max(chunk, batch * 8)
        return times

    def decode(b: int) -> float:
        rids = [f"decode-{next(ids)}" for _ in range(b)]
        for rid in rids:
            engine.add_request(rid, prompt(4), SamplingParams(max_tokens=reps + 2, ignore_eos=True))
        engine.step()  # the prompts, in one step
        times = [timed_step() for _ in range(reps)]
        engine.abort_request(rids)
        return statistics.median(times)

    chunked_prefill(), decode(2)  # warm-up
    chunks = [min(ts) for ts in zip(*(chunked_prefill() for _ in range(3)), strict=True)]
    weight_bytes = None
    try:
        from tessera.quant import weight_memory_bytes

        weight_bytes = weight_memory_bytes(engine.runner.model)
    except (ImportError, AttributeError):
        pass
    return {"decode_1": min(decode(1) for _ in range(2)), "decode_batch": min(decode(batch) for _ in range(2)),
            "batch": batch, "chunk": chunk, "chunks": chunks, "weight_bytes": weight_bytes}


def _fit_costs(info: ModelInfo, quantization: str, raw: dict) -> StepCosts:
    """base and per decode from the two decode timings; per attention pair and per prompt token
    from a least-squares line through the chunk steps' times against their attention pairs."""
    batch, chunk = raw["batch"], raw["chunk"]
    per_decode = max((raw["decode_batch"] - raw["decode_1"]) / (batch - 1), 1e-7)
    base = max(raw["decode_1"] - per_decode, 1e-6)
    xs = [chunk * (k * chunk + chunk / 2) for k in range(len(raw["chunks"]))]
    ys = raw["chunks"]
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / sum((x - mx) ** 2 for x in xs)
    per_pair = max(slope, 0.0)
    intercept = my - per_pair * mx
    per_token = max((intercept - base) / chunk, min(ys) / chunk * 0.1, 1e-8)
    mode = f", {quantization}" if quantization != "none" else ""
    costs = StepCosts(base, per_decode, per_token, source=f"measured on {info.path.name} ({info.dtype}{mode})",
                      weight_bytes=raw["weight_bytes"], per_attention_s=per_pair)
    logger.info("step costs%s: base %.2f ms, %.3f ms per decode, %.4f ms per prefill token, %.2f ns per attention "
                "pair", mode, costs.base_s * 1e3, costs.per_decode_s * 1e3, costs.per_prefill_token_s * 1e3,
                per_pair * 1e9)
    return costs


# ---- the six stages -------------------------------------------------------------------------------


@dataclass
class MemoryProfile:
    num_params: int
    weight_bytes: dict[str, int]  # per quantization mode
    kv_bytes_per_token: int
    kv_pool_bytes: int  # what the KV pool gets without quantization
    kv_tokens_fit: dict[str, int]  # per mode: the pool plus the weight memory the mode frees
    # The memory levers: bytes per token of each --kv-cache-dtype, and tokens that fit for each
    # (kv dtype, weight mode); the configured kv dtype's row is kv_tokens_fit.
    peak_concurrency: int  # sequences running at once, simulated with no batch limit
    p90_concurrency: float
    mean_concurrency: float  # Little's law: arrival rate x mean time in the system
    peak_kv_tokens: int
    p90_kv_tokens: float
    largest_request_tokens: int
    # The memory levers: bytes per token of each --kv-cache-dtype, and the tokens that fit for
    # each (kv dtype, weight mode); the configured kv dtype's row is kv_tokens_fit.
    kv_dtype: str = "auto"
    kv_bytes_by_dtype: dict[str, int] = field(default_factory=dict)
    kv_tokens_fit_by_dtype: dict[str, dict[str, int]] = field(default_factory=dict)

    @property
    def tokens_per_sequence(self) -> float:
        """KV tokens a running sequence holds at the peak, on average (what one more costs)."""
        return self.peak_kv_tokens / self.peak_concurrency if self.peak_concurrency else float(self.largest_request_tokens)

    def sequences_fit(self, kv_dtype: str, mode: str = "none") -> int:
        """Sequences of the peak's average size that fit the pool with these levers."""
        return int(self.kv_tokens_fit_by_dtype[kv_dtype][mode] // max(self.tokens_per_sequence, 1.0))


@dataclass
class PrefixProfile:
    block_size: int
    hit_rate: float  # prefix-cache hits / prompt tokens looked up
    hit_tokens: int
    query_tokens: int
    requests_with_hits: float  # fraction
    hit_rate_curve: list[tuple[int, float]]  # (pool tokens, hit rate)
    cached_tokens: list[int] = field(default_factory=list, repr=False)  # per request, for the simulation


@dataclass
class LengthStats:
    mean: float
    p50: float
    p90: float
    p99: float
    max: int
    cv: float  # coefficient of variation

    @classmethod
    def of(cls, values: list[int]) -> LengthStats:
        return cls(statistics.fmean(values), percentile(values, 50), percentile(values, 90), percentile(values, 99),
                   max(values), coefficient_of_variation(values))


@dataclass
class HeterogeneityProfile:
    prompt_len: LengthStats
    output_len: LengthStats
    static_batch_size: int
    static_waste: float  # fraction of the token slots static batching pads
    continuous_waste: float  # the same for continuous batching (prefill chunk tails only)


@dataclass
class FragmentationProfile:
    block_size: int
    max_model_len: int
    peak_paged_tokens: int  # whole blocks held by running sequences, at the simulated peak
    peak_used_tokens: int  # tokens those sequences actually hold
    peak_reserved_tokens: int  # contiguous prompt + max_tokens reservations at the same time
    peak_max_len_tokens: int  # contiguous max_model_len reservations at the peak concurrency
    paged_waste: float  # 1 - used / paged
    reserved_waste: float  # 1 - used / reserved


@dataclass
class SpeculationProfile:
    method: str
    num_speculative_tokens: int
    requests_with_outputs: int
    acceptance_rate: float  # accepted draft tokens / proposed draft tokens
    tokens_per_step: float  # output tokens per verification step (1 = no gain)
    draft_coverage: float  # fraction of steps that had a draft to verify
    proposed_per_step: float  # draft tokens verified per step, on average
    speedup_by_batch: dict[int, float]  # modelled decode speedup at these batch sizes
    measured: bool = False  # True when run through the engine's speculative decoder


@dataclass
class ScaleProfile:
    duration_s: float
    arrival_rate: float
    peak_rate_1s: float
    interarrival_cv: float  # 1 for Poisson arrivals, larger for bursts
    prefill_share: float
    decode_share: float
    slo_ttft_ms: float
    slo_itl_ms: float
    goodput_one_engine: float
    goodput_two_colocated: float
    goodput_disaggregated: float  # one prefill worker + one decode worker
    disaggregation_gain: float  # goodput_disaggregated / goodput_two_colocated


@dataclass
class Profile:
    model: str
    num_requests: int
    costs: StepCosts
    costs_by_mode: dict[str, StepCosts]  # quantization mode -> measured step costs (none included)
    memory: MemoryProfile
    prefix: PrefixProfile
    heterogeneity: HeterogeneityProfile
    fragmentation: FragmentationProfile
    speculation: SpeculationProfile | None
    scale: ScaleProfile
    engine: dict  # the engine settings the profile assumed (block size, budget, ...)
    requests: list[SimRequest] = field(default_factory=list, repr=False)

    def to_json(self) -> dict:
        d = dataclasses.asdict(self)
        d.pop("requests")
        d["prefix"].pop("cached_tokens")
        return d


def memory_profile(info: ModelInfo, kv_pool_bytes: int, modes: list[str], sim: SimResult,
                   requests: list[SimRequest], arrival_rate: float,
                   costs_by_mode: dict[str, StepCosts] | None = None, kv_dtype: str = "auto") -> MemoryProfile:
    """Weights per mode (measured where the mode's engine was timed, else estimated); the KV
    tokens that fit when the memory a mode frees from the weights goes to the KV pool."""
    n = info.num_params()
    weights = {}
    for mode in modes:
        measured = (costs_by_mode or {}).get(mode)
        weights[mode] = measured.weight_bytes if measured and measured.weight_bytes else info.weight_bytes(mode)
    from tessera.config import KV_CACHE_DTYPES

    by_dtype = {d: info.kv_bytes_per_token(d) for d in KV_CACHE_DTYPES}
    fit_by_dtype = {d: {mode: (kv_pool_bytes + weights["none"] - w) // b for mode, w in weights.items()}
                    for d, b in by_dtype.items()}
    kvpt, fit = by_dtype[kv_dtype], fit_by_dtype[kv_dtype]
    latencies = [o.finish - r.arrival for o, r in zip(sim.outcomes, requests, strict=True)]
    return MemoryProfile(
        num_params=n, weight_bytes=weights, kv_bytes_per_token=kvpt, kv_pool_bytes=kv_pool_bytes, kv_tokens_fit=fit,
        peak_concurrency=sim.peak("running"), p90_concurrency=sim.percentile("running", 90),
        mean_concurrency=arrival_rate * statistics.fmean(latencies) if latencies else 0.0,
        peak_kv_tokens=sim.peak("kv_tokens"), p90_kv_tokens=sim.percentile("kv_tokens", 90),
        largest_request_tokens=max(r.prompt_len + r.output_len for r in requests),
        kv_dtype=kv_dtype, kv_bytes_by_dtype=by_dtype, kv_tokens_fit_by_dtype=fit_by_dtype,
    )


def prefix_profile(prompts: list[list[int]], outputs: list[list[int] | None], block_size: int = 16,
                   pool_tokens: int | None = None, curve_points: int = 6) -> PrefixProfile:
    """Replay the prompts (and the outputs, when known: a server caches generated blocks too) in
    order through KVCacheManager's hashing with a pool of `pool_tokens` (default: all of them)."""
    total = sum(len(p) + len(o or ()) for p, o in zip(prompts, outputs, strict=True))
    full_pool = -(-total // block_size) * block_size + block_size
    pool = min(pool_tokens or full_pool, full_pool)
    hits, queries, cached = _replay_prefix(prompts, outputs, block_size, pool)
    curve = []
    for i in range(curve_points, 0, -1):
        size = max(block_size * 2, pool >> (i - 1) if i > 1 else pool)
        if curve and size == curve[-1][0]:
            continue
        h, q, _ = _replay_prefix(prompts, outputs, block_size, size) if size != pool else (hits, queries, None)
        curve.append((size, h / q if q else 0.0))
    return PrefixProfile(block_size, hits / queries if queries else 0.0, hits, queries,
                         sum(c > 0 for c in cached) / len(cached) if cached else 0.0, curve, cached)


def _replay_prefix(prompts, outputs, block_size: int, pool_tokens: int) -> tuple[int, int, list[int]]:
    from tessera.engine.kv_cache import KVCacheManager
    from tessera.engine.request import Sequence
    from tessera.sampling import SamplingParams

    kv = KVCacheManager(pool_tokens // block_size + 1, block_size, enable_prefix_caching=True)
    params = SamplingParams(max_tokens=1)
    cached = []
    for i, (prompt, output) in enumerate(zip(prompts, outputs, strict=True)):
        seq = Sequence(f"replay-{i}", list(prompt), params)
        if kv.num_blocks_for(len(prompt) + len(output or ())) > kv.num_usable_blocks or not kv.allocate_for_admission(
                seq, len(prompt)):
            cached.append(0)
            continue
        cached.append(seq.num_cached_tokens)
        seq.num_computed_tokens = len(prompt)
        kv.commit_computed(seq)
        if output:
            seq.output_token_ids = list(output)
            kv.allocate_slots(seq, len(output))
            seq.num_computed_tokens = seq.num_tokens
            kv.commit_computed(seq)
        kv.free(seq)
    return kv.prefix_hits, kv.prefix_queries, cached


def heterogeneity_profile(prompt_lens: list[int], output_lens: list[int], batch_size: int,
                          chunk_budget: int = 512) -> HeterogeneityProfile:
    """Static batching: batches of `batch_size` in arrival order, each padded to its longest
    prompt and run until its longest output ends. Continuous batching only pads nothing; its one
    loss is the budget left unused by the last chunk of a prompt, bounded here per prompt."""
    useful = padded = 0
    for i in range(0, len(prompt_lens), batch_size):
        ps, os_ = prompt_lens[i : i + batch_size], output_lens[i : i + batch_size]
        useful += sum(ps) + sum(os_)
        padded += len(ps) * (max(ps) + max(os_))
    idle = sum((-p) % chunk_budget for p in prompt_lens if p > chunk_budget)
    total = sum(prompt_lens) + sum(output_lens)
    return HeterogeneityProfile(LengthStats.of(prompt_lens), LengthStats.of(output_lens), batch_size,
                                1 - useful / padded if padded else 0.0, idle / (total + idle) if total else 0.0)


def fragmentation_profile(sim: SimResult, block_size: int, max_model_len: int) -> FragmentationProfile:
    peak = max(sim.timeline, key=lambda row: (row.paged_tokens, row.kv_tokens))
    return FragmentationProfile(
        block_size=block_size, max_model_len=max_model_len, peak_paged_tokens=peak.paged_tokens,
        peak_used_tokens=peak.kv_tokens, peak_reserved_tokens=peak.reserved_tokens,
        peak_max_len_tokens=sim.peak("running") * max_model_len,
        paged_waste=1 - peak.kv_tokens / peak.paged_tokens if peak.paged_tokens else 0.0,
        reserved_waste=1 - peak.kv_tokens / peak.reserved_tokens if peak.reserved_tokens else 0.0,
    )


def ngram_acceptance(prompt: list[int], output: list[int], k: int = 4, n_max: int = 3,
                     n_min: int = 1, use_engine_proposer: bool = True) -> tuple[int, int, int, int]:
    """Prompt-lookup speculation replayed on a known output: at each step the proposer drafts up
    to k tokens from the context so far; the accepted ones are the draft's prefix the output
    really continues with, plus one token the verification step samples itself. Uses the
    engine's own proposer (tessera.spec.ngram) when this build has one. Returns (steps,
    drafted steps, proposed tokens, accepted tokens)."""
    propose = (use_engine_proposer and _engine_ngram_proposer(prompt, n_max, n_min)) or _simple_ngram_proposer(
        prompt, n_max, n_min)
    steps = drafted = proposed = accepted = 0
    i = 0
    while i < len(output):
        draft = propose(k)
        good = 0
        while good < len(draft) and i + good < len(output) and draft[good] == output[i + good]:
            good += 1
        steps += 1
        drafted += bool(draft)
        proposed += len(draft)
        accepted += good
        advance = min(good + 1, len(output) - i)
        propose.extend(output[i : i + advance])
        i += advance
    return steps, drafted, proposed, accepted


class _simple_ngram_proposer:
    """The most recent earlier occurrence of the context's last n tokens (n_max down to n_min)
    proposes the k tokens that followed it."""

    def __init__(self, prompt: list[int], n_max: int, n_min: int) -> None:
        self.n_max, self.n_min = n_max, n_min
        self.ctx: list[int] = []
        self.index: list[dict[tuple, int]] = [{} for _ in range(n_max + 1)]  # n -> n-gram -> end
        self.extend(prompt)

    def extend(self, tokens: list[int]) -> None:
        ctx = self.ctx
        for tok in tokens:
            end = len(ctx)  # the n-grams ending here now have a follower
            for n in range(self.n_min, self.n_max + 1):
                if end >= n:
                    self.index[n][tuple(ctx[end - n : end])] = end
            ctx.append(tok)

    def __call__(self, k: int) -> list[int]:
        ctx = self.ctx
        for n in range(self.n_max, self.n_min - 1, -1):
            if len(ctx) >= n:
                end = self.index[n].get(tuple(ctx[-n:]))
                if end is not None:
                    return ctx[end : end + k]
        return []


def _engine_ngram_proposer(prompt: list[int], n_max: int, n_min: int):
    try:
        from tessera.spec.ngram import NgramProposer
    except ImportError:
        return None
    from tessera.engine.request import Sequence
    from tessera.sampling import SamplingParams

    proposer, seq = NgramProposer(n_max, n_min), Sequence("ngram-estimate", list(prompt), SamplingParams())

    class _Propose:
        def __call__(self, k: int) -> list[int]:
            return proposer.propose(seq, k)

        def extend(self, tokens: list[int]) -> None:
            seq.output_token_ids.extend(tokens)

    return _Propose()


def speculation_profile(prompts: list[list[int]], outputs: list[list[int] | None], costs: StepCosts,
                        batch_sizes: list[int], k: int = 4) -> SpeculationProfile | None:
    pairs = [(p, o) for p, o in zip(prompts, outputs, strict=True) if o]
    if not pairs:
        return None
    steps = drafted = proposed = accepted = tokens = 0
    for p, o in pairs:
        s, d, pr, a = ngram_acceptance(p, o, k)
        steps, drafted, proposed, accepted, tokens = steps + s, drafted + d, proposed + pr, accepted + a, tokens + len(o)
    per_step = tokens / steps
    mean_proposed = proposed / steps
    speedup = {}
    for b in sorted(set(max(1, int(b)) for b in batch_sizes)):
        plain = costs.step_time(0, b)
        verify = plain + costs.per_prefill_token_s * b * mean_proposed  # the draft tokens ride along
        speedup[b] = per_step * plain / verify
    return SpeculationProfile("ngram", k, len(pairs), accepted / proposed if proposed else 0.0, per_step,
                              drafted / steps, mean_proposed, speedup)


def scale_profile(requests: list[SimRequest], costs: StepCosts, sim: SimResult, budget: int, max_num_seqs: int,
                  kv_bytes_per_token: int, slo_ttft_ms: float, slo_itl_ms: float,
                  transfer_bytes_per_s: float = DEFAULT_TRANSFER_BYTES_PER_S) -> ScaleProfile:
    arrivals = sorted(r.arrival for r in requests)
    duration = arrivals[-1] - arrivals[0]
    rate = (len(arrivals) - 1) / duration if duration > 0 else float(len(arrivals))
    peak, j = 0, 0
    for i, t in enumerate(arrivals):
        while arrivals[j] < t - 1.0:
            j += 1
        peak = max(peak, i - j + 1)
    total = sim.prefill_time_s + sim.decode_time_s
    slo = (slo_ttft_ms / 1e3, slo_itl_ms / 1e3)
    two = simulate_replicas(requests, costs, budget, max_num_seqs, 2).goodput(*slo)
    split = simulate_disaggregated(requests, costs, budget, max_num_seqs,
                                   kv_bytes_per_token / transfer_bytes_per_s).goodput(*slo)
    return ScaleProfile(
        duration_s=duration, arrival_rate=rate, peak_rate_1s=float(peak),
        interarrival_cv=coefficient_of_variation(next_arrival_gaps(arrivals)),
        prefill_share=sim.prefill_time_s / total if total else 0.0,
        decode_share=sim.decode_time_s / total if total else 0.0,
        slo_ttft_ms=slo_ttft_ms, slo_itl_ms=slo_itl_ms, goodput_one_engine=sim.goodput(*slo),
        goodput_two_colocated=two, goodput_disaggregated=split,
        disaggregation_gain=split / two if two > 0 else (float("inf") if split > 0 else 1.0),
    )


# ---- the whole profile --------------------------------------------------------------------------


def default_kv_pool_bytes(config: EngineConfig) -> int:
    from tessera.engine.kv_sizing import DEFAULT_KV_CAP_BYTES, available_memory_bytes

    if config.kv_cache_memory is not None:
        return config.kv_cache_memory
    return min(int(available_memory_bytes() * config.kv_cache_memory_fraction), DEFAULT_KV_CAP_BYTES)


def profile_trace(trace: list[TraceRequest], info: ModelInfo, costs: StepCosts, config: EngineConfig | None = None,
                  slo_ttft_ms: float = DEFAULT_SLO_TTFT_MS, slo_itl_ms: float = DEFAULT_SLO_ITL_MS,
                  tokenizer=None, num_speculative_tokens: int | None = None,
                  costs_by_mode: dict[str, StepCosts] | None = None) -> Profile:
    """All six stages for `trace` on the model `info`, with the engine settings of `config`.
    `costs` are the unquantized step costs; `costs_by_mode` adds those of quantization modes."""
    costs_by_mode = {**(costs_by_mode or {}), "none": costs}
    if num_speculative_tokens is None:  # the engine's k where it has speculation
        num_speculative_tokens = getattr(config or EngineConfig(), "num_speculative_tokens", 4)
    config = config or EngineConfig(model=info.name)
    bs, budget = config.block_size, config.max_num_batched_tokens
    prompts = [prompt_token_ids(r, tokenizer) for r in trace]
    outputs = [list(r.output_token_ids) if r.output_token_ids is not None
               else (tokenizer.encode(r.output, add_special_tokens=False) if r.output and tokenizer else None)
               for r in trace]
    out_lens = [len(o) if o is not None else (r.max_tokens or 256) for r, o in zip(trace, outputs, strict=True)]
    for r, p, n in zip(trace, prompts, out_lens, strict=True):
        if len(p) + n > info.max_model_len:
            logger.warning("request %s: prompt %d + output %d tokens exceed max_model_len %d; the simulation "
                           "keeps it", r.id or "?", len(p), n, info.max_model_len)
    kv_pool = default_kv_pool_bytes(config)
    kv_dtype = getattr(config, "kv_cache_dtype", "auto")
    pool_tokens = kv_pool // info.kv_bytes_per_token(kv_dtype)
    prefix = prefix_profile(prompts, outputs, bs, pool_tokens)
    use_cache = config.enable_prefix_caching
    requests = [SimRequest(r.arrival_time, len(p), n, cached_len=c if use_cache else 0,
                           reserved_len=len(p) + (r.max_tokens or info.max_model_len - len(p)))
                for r, p, n, c in zip(trace, prompts, out_lens, prefix.cached_tokens, strict=True)]
    # The concurrency the trace needs: no batch limit, the configured budget.
    unlimited = simulate(requests, costs, max(budget, UNLIMITED_SEQS), UNLIMITED_SEQS, block_size=bs)
    configured = simulate(requests, costs, budget, config.max_num_seqs, kv_capacity_tokens=pool_tokens, block_size=bs)
    duration = max(r.arrival_time for r in trace) - min(r.arrival_time for r in trace)
    rate = (len(trace) - 1) / duration if duration > 0 else float(len(trace))
    memory = memory_profile(info, kv_pool, quantization_modes(info.path), unlimited, requests, rate, costs_by_mode,
                            kv_dtype)
    hetero = heterogeneity_profile([len(p) for p in prompts], out_lens,
                                   max(2, min(config.max_num_seqs, memory.peak_concurrency)), budget)
    frag = fragmentation_profile(unlimited, bs, info.max_model_len)
    batches = [1, max(1, round(configured.percentile("running", 50))), max(1, configured.peak("running"))]
    spec = speculation_profile(prompts, outputs, costs, batches, num_speculative_tokens)
    scale = scale_profile(requests, costs, configured, budget, config.max_num_seqs, info.kv_bytes_per_token(kv_dtype),
                          slo_ttft_ms, slo_itl_ms)
    engine = {"block_size": bs, "max_num_batched_tokens": budget, "max_num_seqs": config.max_num_seqs,
              "enable_prefix_caching": config.enable_prefix_caching, "kv_pool_tokens": pool_tokens,
              "max_model_len": info.max_model_len, "kv_cache_dtype": kv_dtype}
    return Profile(info.name, len(trace), costs, costs_by_mode, memory, prefix, hetero, frag, spec, scale, engine,
                   requests)
