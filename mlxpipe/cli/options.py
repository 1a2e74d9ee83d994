"""Every command-line option, defined once.

The argument parser, the man page's OPTIONS section and the README's option table are all produced
from :data:`OPTIONS`, so adding an option is one edit here (plus the code that uses it).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, NoReturn

from .. import __version__
from ..interface import DTYPES

GROUPS = {
    "input": "Input",
    "generation": "Generation",
    "structured": "Structured output",
    "output": "Output",
    "model": "Model",
    "general": "General",
}


@dataclass(frozen=True)
class Option:
    """One option: its flags, parser behaviour, and the text shown in --help, the man page and README.

    ``help`` is shown everywhere; ``man`` is extra detail for the man page only.
    """

    flags: tuple[str, ...]
    group: str
    help: str
    metavar: str | None = None
    type: Callable[[str], Any] | None = None
    default: Any = None
    action: str | None = None
    choices: tuple[str, ...] | None = None
    dest: str | None = None
    const: Any = None
    man: str = ""

    @property
    def name(self) -> str:
        return self.flags[-1]

    @property
    def allowed(self) -> str:
        """`` FORMAT is one of: lines, jsonl.`` for an option with choices, else empty."""
        if not (self.choices and self.metavar):
            return ""
        return f" {self.metavar} is one of: {', '.join(self.choices)}."

    def signature(self) -> str:
        """``-n, --max-tokens N`` as shown in the man page and README."""
        flags = ", ".join(self.flags)
        return f"{flags} {self.metavar}" if self.metavar else flags


def positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def batch_size(text: str) -> int | str:
    return "auto" if text.strip().lower() == "auto" else positive_int(text)


def non_negative_int(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {value}")
    return value


def non_negative_float(text: str) -> float:
    value = float(text)
    if not value >= 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {text}")
    return value


def seed_int(text: str) -> int:
    value = int(text)
    if not 0 <= value < 1 << 64:
        raise argparse.ArgumentTypeError(f"must be between 0 and 2**64-1, got {value}")
    return value


def probability(text: str) -> float:
    value = float(text)
    if not 0 <= value <= 1:
        raise argparse.ArgumentTypeError(f"must be between 0 and 1, got {text}")
    return value


def json_object(text: str) -> dict[str, Any]:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise argparse.ArgumentTypeError(f"not valid JSON: {exc}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError("must be a JSON object")
    return value


OPTIONS: tuple[Option, ...] = (
    # Input
    Option(
        ("-p", "--prompt"),
        "input",
        "A prompt to answer: one record each time it is given; stdin is then not read. With --slurp, "
        "the instruction put before each document (after a blank line).",
        metavar="TEXT",
        action="append",
        man="Positional arguments are always FILEs, never prompts. Without --slurp, -p cannot be combined "
        "with a FILE. A TEXT that starts with a dash is given as --prompt=TEXT.",
    ),
    Option(
        ("--slurp",),
        "input",
        "Read all of stdin, or each FILE, as one record (a document) instead of one record per line; "
        "in a --template it is {text}.",
        action="store_true",
        man="The document is the input with its trailing newlines removed; it must be UTF-8 and at most "
        "--max-line-bytes long. With -p TEXT the prompt is TEXT, a blank line, then the document; for any "
        "other shape give --template (for example --template 'Translate to French:\\n\\n{text}').",
    ),
    Option(
        ("--in",),
        "input",
        "Input format: one prompt per line, JSONL objects, or OpenAI Batch API requests (default: lines; "
        "jsonl with --out openai).",
        metavar="FORMAT",
        choices=("lines", "jsonl", "openai"),
        default="lines",
        dest="in_format",
    ),
    Option(("--jsonl",), "input", "Short for --in jsonl --out jsonl.", action="store_true"),
    Option(
        ("-z", "--null"),
        "input",
        "Records are separated by NUL bytes, on input and output.",
        action="store_true",
    ),
    Option(
        ("--prompt-key",),
        "input",
        "JSONL field holding the prompt (default: prompt).",
        metavar="KEY",
        default="prompt",
    ),
    Option(
        ("--template",),
        "input",
        "Build each prompt from the record: {name} is replaced by the record's "
        "field ({text} or {line}, the record's text, in lines mode); {{ and }} are literal braces.",
        metavar="TEXT",
        man="A field that is not a string is inserted as JSON; a record without the field is an error. "
        "Only plain names are allowed.",
    ),
    Option(("--template-file",), "input", "Read the --template text from FILE.", metavar="FILE"),
    Option(
        ("--max-line-bytes",),
        "input",
        "Records longer than this are errors (default: 1048576).",
        metavar="N",
        type=positive_int,
        default=1 << 20,
    ),
    # Generation
    Option(
        ("-n", "--max-tokens"),
        "generation",
        "Most tokens to generate per record (default: 256).",
        metavar="N",
        type=positive_int,
        default=256,
    ),
    Option(
        ("--temp",),
        "generation",
        "Sampling temperature; 0 is greedy (default: 0).",
        metavar="T",
        type=non_negative_float,
        default=0.0,
    ),
    Option(
        ("--top-p",),
        "generation",
        "Nucleus sampling: keep the smallest set of tokens whose probability reaches P (0 = off).",
        metavar="P",
        type=probability,
        default=0.0,
    ),
    Option(
        ("--top-k",),
        "generation",
        "Sample from the K most likely tokens (0 = off).",
        metavar="K",
        type=non_negative_int,
        default=0,
    ),
    Option(
        ("--min-p",),
        "generation",
        "Drop tokens less likely than P times the most likely (0 = off).",
        metavar="P",
        type=probability,
        default=0.0,
    ),
    Option(
        ("--repetition-penalty",),
        "generation",
        "Penalise tokens repeated in the last 20 (1 = off).",
        metavar="R",
        type=non_negative_float,
    ),
    Option(
        ("--seed",),
        "generation",
        "Random seed, applied to each record, so an answer does not depend on its position in the input.",
        metavar="N",
        type=seed_int,
    ),
    Option(
        ("--samples",),
        "generation",
        "Answer each record N times, each sample with its own seed derived from the record's (a JSONL "
        "record's own 'n', an OpenAI request's 'body.n', overrides it). JSONL events carry 'sample' (0 to "
        "N-1), --out openai gives one line with N choices, and text output gives each sample as an answer "
        "of its own, in a row (default: 1).",
        metavar="N",
        type=positive_int,
        default=1,
        man="A record's samples are in order, after each other, and do not depend on its neighbours or "
        "the batch size; they share the record's prompt, read once. At temperature 0 (the default) every "
        "sample is the same greedy answer: mlxpipe answers them and says so once on standard error. With "
        "--one-line or -z, output line i*N + s is input line i's sample s (a blank input line gives N "
        "empty lines). With --resume, each sample is done on its own (--out jsonl), or the record once its "
        "line with every choice is written (--out openai). Not with --chat.",
    ),
    Option(("-s", "--system"), "generation", "System prompt for the chat template.", metavar="TEXT"),
    Option(
        ("--raw",), "generation", "Send the prompt verbatim, without the chat template.", action="store_true"
    ),
    Option(
        ("--chat-template-args",),
        "generation",
        "Extra arguments for the chat template, as a JSON object.",
        metavar="JSON",
        type=json_object,
    ),
    Option(
        ("--stop",),
        "generation",
        "Stop when the text contains STR, which is left out (repeatable).",
        metavar="STR",
        action="append",
    ),
    Option(
        ("-b", "--batch"),
        "generation",
        "Generate up to N records at once (continuous batching); output stays in input order. auto (the "
        "default): one record at a time when reading a terminal or with --chat, else the backend's "
        "batch size (64 on a CPU or a GPU) as far as memory allows (--model-info and --stats say "
        "which); 1: one after another.",
        metavar="N",
        type=batch_size,
        default="auto",
    ),
    Option(
        ("--chat",),
        "generation",
        "Keep a conversation: each record is the next user turn, answered with the earlier turns and "
        "answers as context (the default in interactive mode).",
        action="store_const",
        const=True,
        dest="chat",
        man="The chat template is applied to the whole history. Needs the model's chat template (not "
        "--raw), lines input and --batch 1.",
    ),
    Option(
        ("--no-chat",),
        "generation",
        "Answer each record on its own, also in interactive mode.",
        action="store_const",
        const=False,
        dest="chat",
    ),
    Option(
        ("--no-prefix-cache",),
        "generation",
        "Do not reuse the KV cache of the prompt start that records share (system prompt, template).",
        action="store_true",
    ),
    # Structured output
    Option(
        ("--json-schema",),
        "structured",
        "Every answer is JSON valid against SCHEMA (inline JSON, or a file holding it); the done event "
        "carries it parsed, as 'json'. A JSONL record's own 'json_schema' object overrides it.",
        metavar="SCHEMA",
    ),
    Option(
        ("--choices",),
        "structured",
        "Every answer is exactly one of the comma-separated labels, the most probable one under the model; "
        "the done event carries each label's probability, as 'choices'. A JSONL record's own 'choices' "
        "list overrides it.",
        metavar="A,B,C",
    ),
    Option(("--regex",), "structured", "Every answer matches the regular expression RE.", metavar="RE"),
    Option(
        ("--grammar",),
        "structured",
        "Every answer follows the Lark grammar in FILE (llguidance's dialect; the answer is rule 'start').",
        metavar="FILE",
    ),
    # Output
    Option(
        ("--out",),
        "output",
        "Output format: the streamed text, JSONL events, or OpenAI Batch API output lines (default: text).",
        metavar="FORMAT",
        choices=("text", "jsonl", "openai"),
        default="text",
        dest="out_format",
    ),
    Option(
        ("--no-stream",),
        "output",
        "JSONL: only done and error events, one line per record.",
        action="store_true",
    ),
    Option(
        ("--one-line",),
        "output",
        "Text: newlines inside an answer become spaces, so output line N answers input line N.",
        action="store_true",
        man="Every input line gets exactly one output line: a blank input line (skipped, not a record) an "
        "empty one, a failed record an empty one (its error is on standard error). With -z the same holds "
        "for NUL-separated records, with or without --one-line.",
    ),
    Option(
        ("--unordered",),
        "output",
        "With --batch and JSONL output: write events as they come instead of in input order.",
        action="store_true",
    ),
    Option(
        ("--resume",),
        "output",
        "Carry on a job from FILE, its JSONL output so far: records with a done line there are "
        "skipped, new done and error lines are appended to FILE (not stdout). Needs --out jsonl; "
        "implies --no-stream.",
        metavar="FILE",
        man="A record without an id is known by its number, so keep the input unchanged between runs. "
        "A record whose id an earlier record already has is refused with an error line, never skipped "
        "as done.",
    ),
    Option(
        ("--fail-fast",),
        "output",
        "Stop at the first record that fails (exit status 1), after its error line.",
        action="store_true",
    ),
    Option(
        ("--stats",),
        "output",
        "Print a summary line on stderr at the end (with --out jsonl also a summary event, last on stdout).",
        action="store_true",
        man="It gives two rates: the generated tokens over the wall time since the model was loaded "
        "(prompts included; what a job's throughput is), and the rate a record decodes at (its tokens "
        "after the first over their time, as a done event's tps), over all records.",
    ),
    Option(
        ("-q", "--quiet"),
        "output",
        "No progress display on a terminal, and no warning that a CPU fast path is missing.",
        action="store_true",
    ),
    # Model
    Option(
        ("-m", "--model"),
        "model",
        "A .gguf file, an MLX model folder, a Hugging Face repo id or ollama:NAME[:TAG] "
        "(default: $MLXPIPE_MODEL, else the embedded SmolLM2-135M-Instruct).",
        metavar="MODEL",
        man="A .gguf file (llama, qwen2, qwen3, gemma2, gemma3 or phi3; F32, F16, BF16, Q4_0, Q4_1, Q5_0, "
        "Q5_1, Q8_0 and K-quant tensors) is converted once to an MLX model folder, cached under "
        "$XDG_CACHE_HOME/mlxpipe; so is an Ollama model's GGUF, found under $OLLAMA_MODELS. A repo id is "
        "read from the local Hugging Face cache, and downloaded only when it is not there and the hub "
        "answers.",
    ),
    Option(
        ("--dtype",),
        "model",
        "Weights' type for computing (default: auto): auto picks the fastest per backend (on a Linux CPU "
        "a quantized model's own weights, computed by mlxpipe's kernels with no float32 copy; else on a CPU "
        "float32 when memory allows, with an optimized BLAS on Linux; on CUDA with --batch the model's own "
        "16-bit type (float16 for a GGUF) when GPU memory allows; otherwise on a GPU the quantized weights "
        "as loaded, computing in that 16-bit type).",
        metavar="TYPE",
        choices=DTYPES,
        default="auto",
    ),
    Option(
        ("--trust-remote-code",),
        "model",
        "Allow a model whose folder or repo ships its own Python code (for its architecture or "
        "tokenizer) to run that code. Off by default: such models are refused.",
        action="store_true",
    ),
    Option(
        ("--model-info",), "model", "Print a JSON description of the model and exit.", action="store_true"
    ),
    # General
    Option(("-h", "--help"), "general", "Show this help and exit.", action="help"),
    Option(("--version",), "general", "Show the version and exit.", action="version"),
)

EPILOG = """\
With stdin and stderr on a terminal and no FILE or -p, mlxpipe is interactive: a conversation, with
line editing and history; Ctrl-C stops an answer, Ctrl-D (or Ctrl-C at an empty prompt, twice) quits.

examples:
  mlxpipe -p 'What is 2+2?'                      answer one prompt
  cat memo.txt | mlxpipe --slurp -p 'Summarise this memo:'
  mlxpipe < prompts.txt                          answer each line, streaming the text
  mlxpipe --jsonl data.jsonl | jq -r 'select(.event=="done") | .text'
  paste prompts.txt <(mlxpipe --one-line < prompts.txt)
  mlxpipe --template 'Summarise: {text}' --in jsonl --out jsonl --no-stream docs.jsonl
  mlxpipe --choices positive,negative,neutral --template 'Sentiment of: {line}' < reviews.txt

exit status: 0 all records done, 1 some records failed, 2 usage error, 3 model could not be loaded,
130 interrupted (SIGINT), 143 terminated (SIGTERM).  See man mlxpipe.
"""


class _Parser(argparse.ArgumentParser):
    def parse_args(  # type: ignore[override]
        self, args: Sequence[str] | None = None, namespace: None = None
    ) -> argparse.Namespace:
        """argparse's, but an unknown option is named alone, with the nearest real one."""
        parsed, extras = self.parse_known_args(args, namespace)
        if extras:
            self.error(unknown_argument(extras, self._option_string_actions))
        return parsed

    def error(self, message: str) -> NoReturn:
        """A usage error: one line (the error prefix coloured on a terminal), then where help is."""
        from .term import Console

        Console().say(f"{self.prog}: error: {message}")
        print(f"Try '{self.prog} --help'.", file=sys.stderr, flush=True)
        self.exit(2)


def unknown_argument(extras: list[str], known: Iterable[str]) -> str:
    """The message for arguments argparse could not place: the first unknown option, and a guess."""
    import difflib

    unknown = next((a for a in extras if a.startswith("-") and a != "-"), None)
    if unknown is None:
        return f"unexpected argument {extras[0]!r}"
    name = unknown.split("=", 1)[0] if unknown.startswith("--") else unknown
    guess = difflib.get_close_matches(name, [k for k in known if k.startswith("--")], n=1, cutoff=0.6)
    return f"unknown option {name}" + (f" (did you mean {guess[0]}?)" if guess else "")


def build_parser() -> argparse.ArgumentParser:
    """The argument parser, built from :data:`OPTIONS`."""
    parser = _Parser(
        prog="mlxpipe",
        add_help=False,
        allow_abbrev=False,  # --max-token must not quietly mean --max-tokens, nor --prompt --prompt-key
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Run a local language model (mlx-lm) over records from stdin or files.",
    )
    parser.add_argument("files", nargs="*", metavar="FILE", help="input files; none or - reads stdin")
    groups = {key: parser.add_argument_group(title.lower()) for key, title in GROUPS.items()}
    for opt in OPTIONS:
        kwargs: dict[str, Any] = {"help": opt.help + opt.allowed}
        if opt.action == "version":
            kwargs.update(action="version", version=f"mlxpipe {__version__}")
        elif opt.action:
            kwargs["action"] = opt.action
        if opt.action in (None, "append"):
            kwargs["metavar"] = opt.metavar
            if opt.type is not None:
                kwargs["type"] = opt.type
        if opt.action is None:
            kwargs["default"] = opt.default
        if opt.choices:
            kwargs["choices"] = opt.choices
        if opt.dest:
            kwargs["dest"] = opt.dest
        if opt.const is not None:
            kwargs["const"] = opt.const
        groups[opt.group].add_argument(*opt.flags, **kwargs)
    return parser
