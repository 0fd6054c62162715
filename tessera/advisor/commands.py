"""The `tessera profile` and `tessera advise` subcommands, and `tessera serve --config FILE`."""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path

from tessera.config import DEFAULT_MODEL, EngineConfig
from tessera.engine_args import add_engine_arguments, engine_kwargs

logger = logging.getLogger("tessera.advisor")


def add_advisor_commands(sub) -> None:
    prof = sub.add_parser("profile", help="measure a workload trace: memory, prefixes, lengths, "
                                          "fragmentation, speculation, scale (JSON)")
    _add_common(prof)
    prof.add_argument("-o", "--output", default=None, help="write the profile JSON here (default: stdout)")
    prof.set_defaults(func=cmd_profile)

    adv = sub.add_parser("advise", help="walk the optimization decision tree over a trace and write the "
                                        "configuration `tessera serve --config` takes")
    _add_common(adv)
    adv.add_argument("-o", "--output", default="tessera-config.json",
                     help="the configuration file to write (.json, or .yaml/.yml)")
    adv.add_argument("--report", default=None, help="also write a report here: markdown (.md), or one HTML page with its plots inlined (.html); "
                          "plots need matplotlib (the plots extra)")
    adv.add_argument("--json", dest="json_out", default=None, help="also write the profile and decisions as JSON")
    adv.set_defaults(func=cmd_advise)


def _add_common(p: argparse.ArgumentParser) -> None:
    from tessera.advisor.formats import TRACE_FORMATS
    from tessera.advisor.profile import DEFAULT_SLO_ITL_MS, DEFAULT_SLO_TTFT_MS

    p.add_argument("trace", help="a trace: Tessera JSONL (see tessera/advisor/trace.py; `python -m "
                                 "tessera.advisor.trace` writes synthetic ones), Mooncake JSONL, Azure or BurstGPT "
                                 "CSV, ShareGPT JSON")
    p.add_argument("--trace-format", default="auto", choices=("auto", *TRACE_FORMATS),
                   help="the trace's format (default: detected from its first record)")
    p.add_argument("--skip-bad-lines", action="store_true",
                   help="skip trace lines that cannot be read (reported) instead of stopping at the first")
    p.add_argument("--trace-rate", type=float, default=1.0,
                   help="conversations per second for ShareGPT files, which carry no arrival times")
    p.add_argument("--model", default=DEFAULT_MODEL, help="HF folder, .gguf file, or the default model's name")
    p.add_argument("--slo-ttft-ms", type=float, default=DEFAULT_SLO_TTFT_MS, help="time-to-first-token objective")
    p.add_argument("--slo-itl-ms", type=float, default=DEFAULT_SLO_ITL_MS, help="inter-token latency objective")
    p.add_argument("--remeasure", action="store_true", help="time the model's steps again instead of using the cache")
    p.add_argument("--quant-candidates", default="none",
                   help="quantization modes to time for a speed comparison (stage 1), e.g. int8,w8a8, or 'all' (every "
                        "mode this build offers for the model); default none: quantization only when memory needs it")
    add_engine_arguments(p)


def _run_profile(args: argparse.Namespace):
    from tessera.advisor.formats import detect_format
    from tessera.advisor.profile import load_model_info, measure_costs_by_mode, profile_trace, quantization_modes
    from tessera.advisor.trace import read_trace
    from tessera.model.tokenizer import Tokenizer

    config = EngineConfig(model=args.model, **engine_kwargs(args))
    info = load_model_info(args.model, args.dtype, args.max_model_len)
    fmt = detect_format(args.trace) if args.trace_format == "auto" else args.trace_format
    tokenizer = Tokenizer(info.path, info.config) if fmt == "sharegpt" else None
    try:
        trace = read_trace(args.trace, fmt, args.skip_bad_lines, vocab_size=info.config.vocab_size,
                           rate=args.trace_rate, tokenizer=tokenizer)
    except ValueError as exc:
        raise SystemExit(f"error: {exc}") from None
    if tokenizer is None and any(r.prompt_token_ids is None for r in trace):
        tokenizer = Tokenizer(info.path, info.config)
    available = quantization_modes(info.path)
    wanted = available if args.quant_candidates == "all" else args.quant_candidates.split(",")
    unknown = set(wanted) - set(available)
    if unknown:
        raise SystemExit(f"--quant-candidates: {', '.join(sorted(unknown))} not available; choose from "
                         f"{', '.join(available)}")
    modes = ["none", *(m for m in wanted if m != "none")]
    by_mode = measure_costs_by_mode(info, modes, args.dtype, args.num_threads, use_cache=not args.remeasure,
                                    rounds=2 if len(modes) > 1 else 1)
    return profile_trace(trace, info, by_mode.pop("none"), config, args.slo_ttft_ms, args.slo_itl_ms, tokenizer,
                         costs_by_mode=by_mode)


def cmd_profile(args: argparse.Namespace) -> int:
    profile = _run_profile(args)
    text = json.dumps(profile.to_json(), indent=2)
    if args.output:
        Path(args.output).write_text(text + "\n")
        print(f"wrote {args.output}", file=sys.stderr)
    else:
        print(text)
    return 0


def cmd_advise(args: argparse.Namespace) -> int:
    from tessera.advisor.advise import advise, write_config
    from tessera.advisor.report import render_report

    profile = _run_profile(args)
    base = {k: getattr(args, k) for k in ("enable_prefix_caching", "max_num_batched_tokens", "max_num_seqs",
                                          "block_size")}
    advice = advise(profile, base)
    print(format_advice(advice))
    write_config(args.output, advice)
    print(f"\nwrote {args.output}: tessera serve {args.model} --config {args.output}")
    if args.report:
        report = Path(args.report)
        text = render_report(profile, advice, report.parent / (report.stem + "_plots"))
        if report.suffix.lower() in (".html", ".htm"):
            from tessera.advisor.report import markdown_to_html

            text = markdown_to_html(text, report.parent, title=f"Tessera workload report: {args.trace}")
        report.write_text(text)
        print(f"wrote {args.report}")
    if args.json_out:
        Path(args.json_out).write_text(json.dumps({"profile": profile.to_json(), **advice.to_json()}, indent=2))
        print(f"wrote {args.json_out}")
    return 0


def format_advice(advice) -> str:
    lines = []
    for d in advice.decisions:
        lines += [f"[{d.stage}] {d.question}", f"    decision:      {d.decision}", f"    figure:        {d.figure}",
                  f"    threshold:     {d.threshold}", f"    expected gain: {d.expected_gain}"]
    lines += [f"note: {n}" for n in advice.notes]
    return "\n".join(lines)


def apply_config_file(parser: argparse.ArgumentParser, sub: argparse.ArgumentParser, argv: list[str] | None,
                      path: str) -> argparse.Namespace:
    """Parse argv again with the file's settings as the subcommand's defaults, so that flags given
    on the command line override the file whatever their order. Keys are flag names with
    underscores (max_num_batched_tokens) or dashes (max-num-batched-tokens)."""
    from tessera.advisor.advise import read_config

    try:
        values = read_config(path)
    except (OSError, ValueError) as exc:
        parser.error(f"--config {path}: {exc}")
    actions = {a.dest: a for a in sub._actions if a.dest not in ("help", "config")}
    defaults = {}
    for key, value in values.items():
        dest = key.replace("-", "_")
        action = actions.get(dest)
        if action is None:
            parser.error(f"--config {path}: unknown setting {key!r}; known: {', '.join(sorted(actions))}")
        if isinstance(value, str) and action.type is not None:
            value = action.type(value)  # e.g. kv_cache_memory: "2GiB"
        if action.choices is not None and value is not None and value not in action.choices:
            parser.error(f"--config {path}: {key} = {value!r}; choose one of {', '.join(map(str, action.choices))}")
        defaults[dest] = value
    sub.set_defaults(**defaults)
    return parser.parse_args(argv)


# ---- tessera serve: --config, --record-trace, --autopilot --------------------------------------


def add_serve_advisor_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", default=None,
                        help="a JSON/YAML file of serve settings (what `tessera advise` writes); flags given on the "
                             "command line override it")
    parser.add_argument("--record-trace", default=None, metavar="FILE",
                        help="append one JSONL line per request (prompt, sampling, arrival, output) for `tessera advise`")
    parser.add_argument("--autopilot", action="store_true",
                        help="adapt prefix caching, the chunked-prefill budget and n-gram speculation from live metrics "
                             "(see --slo-*)")
    parser.add_argument("--slo-ttft-ms", type=float, default=None, help="time-to-first-token objective (autopilot)")
    parser.add_argument("--slo-itl-ms", type=float, default=None, help="inter-token latency objective (autopilot)")


def attach_serve_advisor(app, args: argparse.Namespace) -> None:
    """Hook the trace recorder and the autopilot into a created app's engine, before it serves."""
    from tessera.advisor.trace import FanOutObserver, TraceRecorder, record_requests

    engine = app.state.engine  # the AsyncLLMEngine
    extra = []
    if getattr(args, "record_trace", None):
        recorder = TraceRecorder(args.record_trace)
        record_requests(engine, recorder)
        extra.append(recorder)
    if getattr(args, "autopilot", False):
        from tessera.advisor.autopilot import Autopilot, AutopilotConfig
        from tessera.advisor.profile import cached_step_costs

        costs = cached_step_costs(engine.engine)
        if costs is None:
            logger.info("autopilot: no step costs cached for this model and machine; the budget cap waits for "
                        "measured steps (`tessera profile` caches them)")
        else:
            logger.info("autopilot: step costs %s", costs.source)
        autopilot = Autopilot.for_engine(engine.engine, AutopilotConfig(slo_ttft_ms=args.slo_ttft_ms,
                                                                        slo_itl_ms=args.slo_itl_ms, step_costs=costs))
        app.state.metrics.registry.register(autopilot.collector(app.state.served_model_name))
        app.state.autopilot = autopilot
        extra.append(autopilot)
    if extra:
        # No step has run yet (nothing was submitted), so the engine thread reads the new observer first.
        engine.observer = FanOutObserver(engine.observer, *extra)
