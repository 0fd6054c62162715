"""The `tessera` command: serve | generate | bench (throughput | latency | serve | load)."""

from __future__ import annotations

import argparse
import logging
import sys
import time

from tessera.config import DEFAULT_MODEL
from tessera.engine_args import add_engine_arguments, engine_kwargs


def cmd_generate(args: argparse.Namespace) -> int:
    from tessera import LLM, SamplingParams

    llm = LLM(args.model, **engine_kwargs(args))
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                            seed=args.sample_seed)
    start = time.perf_counter()
    if args.raw:
        out = llm.generate(args.prompt, params, use_tqdm=False)[0]
    else:
        out = llm.chat([{"role": "user", "content": args.prompt}], params, use_tqdm=False)[0]
    elapsed = time.perf_counter() - start
    completion = out.outputs[0]
    print(completion.text)
    n = len(completion.token_ids)
    print(f"[{n} tokens in {elapsed:.2f}s, {n / elapsed:.1f} tokens/s, finish_reason={completion.finish_reason}]",
          file=sys.stderr)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="tessera", description="LLM inference and serving engine")
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", help="generate a reply to one prompt and print it")
    gen.add_argument("prompt")
    gen.add_argument("--model", default=DEFAULT_MODEL, help="HF folder, .gguf file, or the default model's name")
    gen.add_argument("--max-tokens", type=int, default=128)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--sample-seed", type=int, default=None)
    gen.add_argument("--raw", action="store_true", help="plain completion, no chat template")
    add_engine_arguments(gen)
    gen.set_defaults(func=cmd_generate)

    from tessera.quality import add_quality_arguments, cmd_quality

    quality = sub.add_parser("quality", help="perplexity and weight memory of quantization modes on a fixed text")
    add_quality_arguments(quality)
    quality.set_defaults(func=cmd_quality)

    try:
        from tessera.server.args import add_serve_arguments, run_server
    except ImportError:  # the server's dependencies are optional for offline use
        pass
    else:
        serve = sub.add_parser("serve", help="start the OpenAI-compatible HTTP server")
        add_serve_arguments(serve)
        serve.set_defaults(func=run_server)
        _add_bench_commands(sub)
    from tessera.advisor.commands import add_advisor_commands

    add_advisor_commands(sub)

    args, rest = parser.parse_known_args(argv)
    if getattr(args, "config", None):  # serve --config FILE: the file's settings, overridden by the flags given
        from tessera.advisor.commands import apply_config_file

        args = apply_config_file(parser, serve, argv, args.config)
    if rest and not getattr(args, "passes_rest", False):
        parser.error(f"unrecognized arguments: {' '.join(rest)}")
    if getattr(args, "passes_rest", False):
        args.func(rest)
        return 0
    level = (getattr(args, "log_level", None) or "info").upper()
    logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    return int(args.func(args) or 0)


def _add_bench_commands(sub) -> None:
    """`tessera bench load` (tessera.bench.load), `serve` (tessera.bench.serve), `throughput` and
    `latency` (tessera.bench.offline)."""
    from tessera.bench import load

    bench = sub.add_parser("bench", help="benchmarks: offline (throughput, latency) and against a running server (serve, load)")
    bench_sub = bench.add_subparsers(dest="bench_command", required=True)
    load_parser = bench_sub.add_parser("load", help="bounded load with disconnects; checks every stream")
    load.add_arguments(load_parser)
    load_parser.set_defaults(func=lambda args: load.exit_code(load.run(args)))
    from tessera.bench.offline import add_offline_commands

    add_offline_commands(bench_sub)  # throughput, latency: the offline engine

    def serve_bench(rest: list[str]) -> dict:
        from tessera.bench import serve

        return serve.main(rest)

    # Its flags are bench/serve.py's own: they are passed through unparsed (`--help` included).
    bench_sub.add_parser("serve", help="the serving benchmark (TTFT, TPOT, throughput)", add_help=False) \
        .set_defaults(func=serve_bench, passes_rest=True)


if __name__ == "__main__":
    sys.exit(main())
