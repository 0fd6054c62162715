"""One fuzz case: a feature set (how the engine under test is configured) and a workload.

A case is plain data (dataclasses of ints, strings and lists) so that it prints as JSON and a
failure can be replayed exactly: `python -m tests.differential --replay 'JSON'`. `random_case`
draws one from a seeded `random.Random`; everything random about a run comes from that seed.
"""

from __future__ import annotations

import json
import random
from dataclasses import asdict, dataclass, field, fields, replace

# The reference engine's values: a feature set equal to PLAIN runs the way the reference does
# (shrinking walks a failing case's features back towards these, one at a time).
PLAIN = dict(prefix_caching=False, budget=1024, max_num_seqs=64, block_size=16, pool="ample",
             preemption="recompute", swap_space=False, spec="off", num_spec_tokens=4, spec_adaptive=True,
             handoff=False)
# What a case may draw for each feature. kv_cache_dtype and quantization are not varied against
# the plain engine: the reference uses the same (the "int8 against int8 alone").
CHOICES = dict(
    prefix_caching=[True, False],
    budget=[8, 16, 32, 64, 512],
    max_num_seqs=[2, 4, 16, 64],
    block_size=[4, 8, 16],
    pool=["ample", "tiny"],
    preemption=["recompute", "swap", "auto"],
    swap_space=[False, True],
    spec=["off", "ngram", "draft", "draft-int8"],
    num_spec_tokens=[1, 2, 4, 6],
    spec_adaptive=[True, False],
    handoff=[False, True],
    kv_cache_dtype=["auto", "int8", "fp8"],
    quantization=["none", "int8", "int4", "w8a8"],
)
# The longest prompt + output a case makes stays well inside the tiny model's 512 positions.
MAX_PROMPT, MAX_OUTPUT = 200, 24


@dataclass
class Features:
    prefix_caching: bool = False
    budget: int = 1024  # max_num_batched_tokens: the chunked-prefill budget
    max_num_seqs: int = 64
    block_size: int = 16
    pool: str = "ample"  # "tiny": a KV pool that forces preemption
    preemption: str = "recompute"  # recompute | swap | auto (swap and auto need swap_space)
    swap_space: bool = False  # a host KV tier: swap preemption and demotion of evicted cached blocks
    spec: str = "off"  # off | ngram | draft (the target's own weights) | draft-int8 (int8 draft)
    num_spec_tokens: int = 4
    spec_adaptive: bool = True
    handoff: bool = False  # prefill on one engine, decode on another (tessera.engine.handoff)
    kv_cache_dtype: str = "auto"  # the reference uses the same
    quantization: str = "none"  # the reference uses the same

    def reference_key(self) -> tuple[str, str]:
        """What the reference engine shares with this case."""
        return self.kv_cache_dtype, self.quantization

    def active(self) -> list[str]:
        """The features that differ from the plain engine (for coverage and reports)."""
        out = [f"{k}={getattr(self, k)}" for k, v in PLAIN.items() if getattr(self, k) != v]
        if self.spec == "off":
            out = [s for s in out if not s.startswith(("num_spec_tokens", "spec_adaptive"))]
        if not self.swap_space:
            out = [s for s in out if not s.startswith("preemption")]
        out += [f"{k}={getattr(self, k)}" for k in ("kv_cache_dtype", "quantization")
                if getattr(self, k) not in ("auto", "none")]
        return out


@dataclass
class Request:
    rid: str
    prompt: list[int]
    params: dict  # SamplingParams keyword arguments
    arrival_step: int = 0  # the engine step before which it is added
    abort_after: int | None = None  # abort it this many steps after its arrival, if still running


@dataclass
class Case:
    seed: int
    features: Features
    requests: list[Request] = field(default_factory=list)

    def to_json(self) -> str:
        return json.dumps(asdict(self), separators=(",", ":"))

    @classmethod
    def from_json(cls, text: str) -> Case:
        raw = json.loads(text)
        return cls(seed=raw["seed"], features=Features(**raw["features"]),
                   requests=[Request(**r) for r in raw["requests"]])

    def with_features(self, **changes) -> Case:
        return replace(self, features=replace(self.features, **changes))


def random_features(rng: random.Random, choices: dict[str, list] | None = None) -> Features:
    """A random feature set; about a third of cases keep each optional feature at its plain value,
    so that features are seen alone as well as together. `choices` narrows CHOICES per feature
    (e.g. {"quantization": ["none"]})."""
    choices = CHOICES | (choices or {})
    f = Features()
    for name in (f.name for f in fields(Features)):
        if rng.random() < 0.6:
            setattr(f, name, rng.choice(choices[name]))
    if f.swap_space and rng.random() < 0.5:
        # The host tier only acts under pressure: a tiny pool makes swaps and demotions happen.
        f.pool, f.preemption = "tiny", rng.choice(["swap", "swap", "auto"])
    if not f.swap_space and f.preemption != "recompute":
        f.preemption = "recompute"  # swap/auto without a host pool is a config error
    if f.spec != "off" and rng.random() < 0.5 and "none" in choices["quantization"]:
        f.quantization = "none"  # speculation with quantized weights is rarer in practice
    return f


def random_params(rng: random.Random, vocab: int) -> dict:
    """Greedy or seeded sampling (unseeded sampling has no reference to compare with), with
    n > 1, stop token ids, min_tokens, penalties and logprobs sometimes."""
    p: dict = dict(max_tokens=rng.randint(1, MAX_OUTPUT), ignore_eos=rng.random() < 0.7)
    if rng.random() < 0.45:
        p.update(temperature=round(rng.uniform(0.3, 1.5), 3), seed=rng.randrange(2**31))
        if rng.random() < 0.4:
            p["top_p"] = round(rng.uniform(0.5, 0.99), 3)
        if rng.random() < 0.3:
            p["top_k"] = rng.randint(1, 40)
        if rng.random() < 0.15:
            p["min_p"] = round(rng.uniform(0.01, 0.2), 3)
    else:
        p["temperature"] = 0.0
    if rng.random() < 0.25:
        p["n"] = rng.randint(2, 3)
    if rng.random() < 0.2:
        p["stop_token_ids"] = [rng.randrange(vocab) for _ in range(rng.randint(1, 8))]
    if rng.random() < 0.15:
        p["min_tokens"] = rng.randint(0, p["max_tokens"])
    if rng.random() < 0.1:
        p["repetition_penalty"] = round(rng.uniform(1.05, 1.5), 3)
    if rng.random() < 0.1:
        p["logprobs"] = rng.randint(0, 3)
    return p


def random_case(seed: int, vocab: int, choices: dict[str, list] | None = None) -> Case:
    """Features and 1-10 requests: prompts built from a few shared prefixes (some exactly a block
    long or a duplicate of another prompt), staggered arrivals, some aborted partway."""
    rng = random.Random(seed)
    features = random_features(rng, choices)
    stems = [[rng.randrange(vocab) for _ in range(rng.choice([4, 8, 16, 17, 32, 48, 80]))]
             for _ in range(rng.randint(1, 3))]
    requests: list[Request] = []
    for i in range(rng.randint(1, 10)):
        if requests and rng.random() < 0.1:
            prompt = list(rng.choice(requests).prompt)  # the very same prompt again
        else:
            stem = rng.choice(stems) if rng.random() < 0.6 else []
            prompt = stem + [rng.randrange(vocab) for _ in range(rng.randint(1 if stem else 2, 40))]
        prompt = prompt[:MAX_PROMPT]
        arrival = 0 if rng.random() < 0.5 else rng.randint(0, 30)
        abort = rng.randint(0, 12) if rng.random() < 0.1 else None
        requests.append(Request(f"r{i}", prompt, random_params(rng, vocab), arrival, abort))
    return Case(seed, features, requests)
