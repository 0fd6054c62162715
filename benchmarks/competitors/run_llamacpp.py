"""llama.cpp (through llama-cpp-python's C bindings) on the compare.py workload, in its own venv
(/work/competitors/llamacpp, built by setup.sh with GGML_NATIVE). It drives llama_decode
directly, with greedy argmax over the logits in numpy, the way llama.cpp's own batched tools do:

- throughput: all 32 sequences in one context (a KV stream per sequence), prompts prefilled in
  512-token batches, then every decode step carries one token of each sequence, so llama.cpp
  batches as a serving engine would (llama-server with parallel slots does the same);
- single stream: a one-sequence context, prompt in one batch, then one token per decode.

--gguf picks the weights: the packaged Q4_1 file, or an F32/F16 GGUF that convert_gguf.py writes
from it (same values, dequantized). --kv-type f16 is llama.cpp's default KV cache type; f32 matches
an engine that keeps its KV cache in float32. --repack turns on llama.cpp's repacked weight layouts
(AMX / AVX-512 tiles; `use_extra_bufts`, llama.cpp's `--repack`); off by default: with
llama-cpp-python 0.3.36 on an AMX CPU it crashed in llama_decode (DESIGN.md).
"""

from __future__ import annotations

import sys
import time

from common import Timer, load_workload, parts, run_and_write, runner_args, single_stream, throughput_result


def main() -> None:
    ap = runner_args(__doc__)
    ap.add_argument("--gguf", required=True)
    ap.add_argument("--kv-type", choices=["f16", "f32"], default="f16")
    ap.add_argument("--n-batch", type=int, default=512)
    ap.add_argument("--repack", action="store_true", help="llama.cpp's repacked weight layouts (use_extra_bufts)")
    args = ap.parse_args()
    w = load_workload(args.workload)

    def body() -> dict:
        import llama_cpp as lc
        import numpy as np

        threads, out_len = w["threads"], w["output_len"]
        lc.llama_backend_init()
        mparams = lc.llama_model_default_params()
        mparams.n_gpu_layers = 0
        mparams.use_extra_bufts = args.repack
        with Timer() as load:
            model = lc.llama_model_load_from_file(args.gguf.encode(), mparams)
        if not model:
            raise RuntimeError(f"llama.cpp could not load {args.gguf}")
        n_vocab = lc.llama_vocab_n_tokens(lc.llama_model_get_vocab(model))
        kv_type = lc.GGML_TYPE_F32 if args.kv_type == "f32" else lc.GGML_TYPE_F16

        def make_ctx(n_seq: int, ctx_per_seq: int):
            p = lc.llama_context_default_params()
            p.n_ctx, p.n_seq_max = n_seq * ctx_per_seq, n_seq
            p.n_batch = p.n_ubatch = args.n_batch
            p.n_threads = p.n_threads_batch = threads
            p.type_k = p.type_v = kv_type
            p.kv_unified = False  # a KV stream per sequence: each attends only to its own tokens
            p.no_perf = True
            ctx = lc.llama_init_from_model(model, p)
            if not ctx:
                raise RuntimeError(f"llama_init_from_model failed for {n_seq} sequences x {ctx_per_seq}")
            return ctx, p.flash_attn_type

        batch = lc.llama_batch_init(max(args.n_batch, len(w["throughput_prompts"])), 0, 1)

        def decode(ctx, items: list[tuple[int, int, int, bool]]) -> np.ndarray:
            """items: (token, position, sequence, wants logits); returns argmax of each wanted row."""
            for i, (tok, pos, seq, want) in enumerate(items):
                batch.token[i], batch.pos[i], batch.n_seq_id[i] = tok, pos, 1
                batch.seq_id[i][0], batch.logits[i] = seq, want
            batch.n_tokens = len(items)
            rc = lc.llama_decode(ctx, batch)
            if rc != 0:
                raise RuntimeError(f"llama_decode returned {rc}")
            n_out = sum(1 for it in items if it[3])
            if n_out == 0:
                return np.empty(0, dtype=np.int64)
            logits = np.ctypeslib.as_array(lc.llama_get_logits(ctx), shape=(n_out * n_vocab,))
            return logits.reshape(n_out, n_vocab).argmax(axis=1)

        def generate(ctx, prompts: list[list[int]], n: int) -> list[list[int]]:
            lc.llama_memory_clear(lc.llama_get_memory(ctx), True)
            flat = [(tok, pos, s, pos == len(p) - 1) for s, p in enumerate(prompts) for pos, tok in enumerate(p)]
            first: list[int] = []
            for i in range(0, len(flat), args.n_batch):
                first.extend(int(t) for t in decode(ctx, flat[i : i + args.n_batch]))
            outs = [[t] for t in first]
            for step in range(1, n):
                nxt = decode(ctx, [(o[-1], len(p) + step - 1, s, True) for s, (p, o) in enumerate(zip(prompts, outs, strict=True))])
                for o, t in zip(outs, nxt, strict=True):
                    o.append(int(t))  # ignore_eos: EOS is just another token here
            return outs

        prompts = w["throughput_prompts"]
        ctx_len = max(len(p) for p in prompts + w["single_prompts"]) + out_len + 16
        fa_type = []

        def offline() -> dict:
            bctx, fa = make_ctx(len(prompts), ctx_len)
            fa_type.append(fa)
            generate(bctx, prompts[:2], 4)  # warm-up
            t0 = time.perf_counter()
            outs = generate(bctx, prompts, out_len)
            tput = throughput_result(time.perf_counter() - t0, prompts, out_len)
            assert all(len(o) == out_len for o in outs)
            tput["first_request_tokens"] = outs[0]
            t0 = time.perf_counter()
            generate(bctx, w["prefill_prompts"], 1)  # as many fresh prompts, 1 token each: the prefill share
            tput["prefill_only_s"] = time.perf_counter() - t0
            lc.llama_free(bctx)
            return tput

        def single() -> dict:
            sctx, fa = make_ctx(1, ctx_len)
            fa_type.append(fa)
            s = single_stream(lambda p, n: generate(sctx, [p], n), w["single_prompts"], out_len, w["single_reps"])
            lc.llama_free(sctx)
            return s

        measured = parts(w, offline, single)
        fa = fa_type[0]
        return {"version": f"llama-cpp-python {lc.__version__}", "gguf": args.gguf, "kv_cache_type": args.kv_type,
                "threads": threads, "n_batch": args.n_batch, "flash_attn_type": fa, "repack": args.repack,
                "load_s": load.seconds, **measured}

    run_and_write(args.out, body)


if __name__ == "__main__":
    sys.exit(main())
