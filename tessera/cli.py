"""The `tessera` command: serve | generate | quality | profile | advise | bench (throughput | latency | serve | load).

A user's mistake ends in one line on stderr, `tessera: error: ...`, and exit code 2 for a usage
error (a flag or argument) or 1 for a runtime one (a missing model, a busy port); `--debug` or
TESSERA_DEBUG=1 adds the traceback. Every flag's help shows its default.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time
import traceback

from tessera import __version__
from tessera.config import DEFAULT_MODEL
from tessera.engine_args import UsageError, add_engine_arguments, engine_config

# Errors whose message is the whole story for a user (a path, a value, a refused setting).
_USER_ERRORS = (OSError, ValueError, RuntimeError, NotImplementedError, UsageError)


class HelpFormatter(argparse.HelpFormatter):
    """Every option's help ends with its default, unless the sentence already names it."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if "default" in text or action.default is argparse.SUPPRESS or not action.option_strings \
                or isinstance(action, (argparse._HelpAction, argparse._VersionAction)):
            return text
        value = action.default
        if isinstance(action, argparse._StoreFalseAction):
            value = False  # the switch is off unless given
        shown = "unset" if value is None else ("off" if value is False else ("on" if value is True else value))
        return f"{text} (default: {shown})"


class Parser(argparse.ArgumentParser):
    """argparse with HelpFormatter for every (sub)command."""

    def __init__(self, *args, **kwargs) -> None:
        kwargs.setdefault("formatter_class", HelpFormatter)
        super().__init__(*args, **kwargs)


def cmd_generate(args: argparse.Namespace) -> int:
    """Print the reply token by token as the engine produces it, then a timing line on stderr."""
    from tessera import LLM, SamplingParams

    seed = args.sample_seed if args.sample_seed is not None else args.seed
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p, seed=seed)
    llm = LLM.from_config(engine_config(args.model, args))
    engine = llm.engine
    if args.raw:
        prompt = engine.tokenizer.encode(args.prompt)
    else:
        tok = engine.tokenizer
        prompt = tok.encode(tok.apply_chat_template([{"role": "user", "content": args.prompt}]),
                            add_special_tokens=False)
    start = time.perf_counter()
    engine.add_request("generate-0", prompt, params)
    completion = None
    while engine.has_unfinished_requests():
        for out in engine.step():
            completion = out.outputs[0]
            if completion.delta_text:
                sys.stdout.write(completion.delta_text)
                sys.stdout.flush()
    elapsed = time.perf_counter() - start
    print()
    n = len(completion.token_ids) if completion is not None else 0
    reason = completion.finish_reason if completion is not None else None
    print(f"[{n} tokens in {elapsed:.2f}s, {n / elapsed:.1f} tokens/s, finish_reason={reason}]", file=sys.stderr)
    return 0


def build_parser() -> tuple[argparse.ArgumentParser, dict[str, argparse.ArgumentParser]]:
    """The whole command line; returns the parser and its subcommand parsers by name."""
    parser = Parser(prog="tessera", description="Tessera: an LLM inference and serving engine (OpenAI-compatible "
                                                "server, offline generation, benchmarks, an optimization advisor).")
    parser.add_argument("--version", action="version", version=f"tessera {__version__}")
    parser.add_argument("--debug", action="store_true",
                        help="Show the traceback of an error (also TESSERA_DEBUG=1); may be given anywhere.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    subs: dict[str, argparse.ArgumentParser] = {}

    gen = subs["generate"] = sub.add_parser("generate", help="generate a reply to one prompt, streaming it",
                                            description="Generate a reply to one prompt and print it as it comes.")
    gen.add_argument("prompt", help="The prompt (a user message, or plain text with --raw).")
    gen.add_argument("--model", default=DEFAULT_MODEL, help="Model: a Hugging Face folder, a .gguf file, or a "
                                                            "packaged model name.")
    gen.add_argument("--max-tokens", type=int, default=128, help="Most tokens to generate.")
    gen.add_argument("--temperature", type=float, default=0.0, help="Sampling temperature (0: greedy).")
    gen.add_argument("--top-p", type=float, default=1.0, help="Nucleus sampling: keep the smallest set of tokens "
                                                              "with this total probability.")
    gen.add_argument("--sample-seed", type=int, default=None, help=argparse.SUPPRESS)  # old name of --seed
    gen.add_argument("--raw", action="store_true", help="Plain completion of the prompt, no chat template.")
    add_engine_arguments(gen)
    gen.set_defaults(func=cmd_generate)

    from tessera.quality import add_quality_arguments, cmd_quality

    quality = subs["quality"] = sub.add_parser(
        "quality", help="perplexity and weight memory of quantization modes on a fixed text")
    add_quality_arguments(quality)
    quality.set_defaults(func=cmd_quality)

    try:
        from tessera.server.args import add_serve_arguments, run_server
    except ImportError:  # the server's dependencies are optional for offline use
        pass
    else:
        serve = subs["serve"] = sub.add_parser("serve", help="start the OpenAI-compatible HTTP server",
                                               description="Start the OpenAI-compatible HTTP server.")
        add_serve_arguments(serve)
        serve.set_defaults(func=run_server)
        _add_bench_commands(sub, subs)
    from tessera.advisor.commands import add_advisor_commands

    add_advisor_commands(sub)
    subs.update({name: p for name, p in sub.choices.items() if name not in subs})
    return parser, subs


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    debug = "--debug" in argv or os.environ.get("TESSERA_DEBUG", "") not in ("", "0")
    argv = [a for a in argv if a != "--debug"]
    parser, subs = build_parser()
    args, rest = parser.parse_known_args(argv)
    if getattr(args, "config", None):  # serve --config FILE: the file's settings, overridden by the flags given
        from tessera.advisor.commands import apply_config_file

        args = apply_config_file(parser, subs["serve"], argv, args.config)
    if rest and not getattr(args, "passes_rest", False):
        parser.error(f"unrecognized arguments: {' '.join(rest)}")
    level = (getattr(args, "log_level", None) or "info").upper()
    logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if getattr(args, "passes_rest", False):
        return _run(lambda: args.func(rest) is None and 0, debug)  # its result is a report, not a status
    return _run(lambda: args.func(args), debug)


def _run(call, debug: bool) -> int:
    """Run a subcommand; a user's mistake becomes one line on stderr and exit code 2 (usage) or 1."""
    try:
        return int(call() or 0)
    except KeyboardInterrupt:
        print("tessera: interrupted", file=sys.stderr)
        return 130
    except Exception as exc:  # noqa: BLE001 - the one place that turns errors into exit codes
        if debug:
            traceback.print_exc()
        message = str(exc) or type(exc).__name__
        hint = ""
        if not isinstance(exc, _USER_ERRORS):  # not a mistake of the user's: say where to look
            message = f"{type(exc).__name__}: {message}"
            hint = "" if debug else " (--debug or TESSERA_DEBUG=1 shows the traceback)"
        print(f"tessera: error: {message}{hint}", file=sys.stderr)
        return 2 if isinstance(exc, UsageError) else 1


def _add_bench_commands(sub, subs: dict) -> None:
    """`tessera bench load` (tessera.bench.load) and `tessera bench serve` (tessera.bench.serve)."""
    from tessera.bench import load

    bench = subs["bench"] = sub.add_parser("bench", help="load generators and benchmarks against a running server")
    bench_sub = bench.add_subparsers(dest="bench_command", required=True, metavar="BENCH")
    load_parser = subs["bench load"] = bench_sub.add_parser("load", help="bounded load with disconnects; checks "
                                                                         "every stream")
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
