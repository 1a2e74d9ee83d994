"""A word on stderr, before the model loads, about arguments that probably do not do what was meant: an
option with no effect in the chosen mode, a ``.jsonl`` FILE read as lines. The run goes on as asked."""

from __future__ import annotations

import argparse

__all__ = ["advice"]

_JSONL_SUFFIXES = (".jsonl", ".ndjson")


def advice(args: argparse.Namespace, interactive: bool) -> list[str]:
    """The lines to print (each starts ``mlxpipe: ``), possibly none."""
    out: list[str] = []

    def no_effect(option: str, why: str) -> None:
        out.append(f"mlxpipe: warning: {option} has no effect {why}")

    text_out = args.out_format == "text"
    if args.no_stream and text_out and args.resume is None:
        out.append(
            "mlxpipe: warning: --no-stream is for --out jsonl (no chunk events); text output only waits "
            "for each answer to end"
        )
    if args.one_line and not text_out:
        no_effect("--one-line", f"with --out {args.out_format}")
    if args.unordered and args.batch == 1:
        no_effect("--unordered", "without --batch")
    if args.prompt_key != "prompt" and args.in_format == "lines":
        no_effect("--prompt-key", "in lines mode (it names a field of --in jsonl records)")
    if args.prompt_key != "prompt" and args.in_format == "openai":
        no_effect("--prompt-key", "with --in openai (a request's prompt is its body.prompt)")
    if interactive and args.batch > 1:
        no_effect("--batch", "in interactive mode (one line is answered at a time)")
    if args.chat is False and not interactive:
        no_effect("--no-chat", "outside interactive mode (records are answered on their own anyway)")
    if args.in_format == "lines" and not args.slurp:
        for name in args.files:
            if name.lower().endswith(_JSONL_SUFFIXES):
                out.append(
                    f"mlxpipe: hint: {name} is read as lines, each a prompt; "
                    "for JSON records add --in jsonl (or --jsonl)"
                )
                break
    return out
