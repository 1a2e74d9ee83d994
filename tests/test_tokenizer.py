"""The engine's own tokenizer (mlxpipe/engine/tokenizer.py: tokenizers + jinja2, no transformers) answers as
mlx-lm's ``TokenizerWrapper`` does, on the embedded model and on a SentencePiece GGUF; and a one-record run of
the command never imports transformers."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from conftest import MLXPIPE, REPO, cli_env
from gguf_factory import trained_spm, write_gguf

from mlxpipe import models

TEXTS = [
    "hi",
    "What is the capital of France?",
    "Café naïve façade 東京は晴れ 北京欢迎你 🌸👩‍👩‍👧🇫🇷 ünïcödé",
    "   leading and trailing spaces   \n\n  Indented\r\nline\tand a tab",
    "def f(x):\n    return x**2  # it's, we'll, I'd, THEY'RE 1234567",
    "<|im_start|>user\nspecial tokens in the text<|im_end|>",
]
CONVERSATIONS: list[list[dict[str, str]]] = [
    [{"role": "user", "content": "hi"}],
    [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Name a colour."}],
    [
        {"role": "user", "content": "My name is Bob."},
        {"role": "assistant", "content": "Hello Bob!"},
        {"role": "user", "content": "What is my name? 東京 🌸"},
    ],
]


def _both(folder: str) -> tuple[Any, Any]:
    from mlx_lm.tokenizer_utils import load as load_tokenizer
    from mlx_lm.utils import load_config

    from mlxpipe.engine import tokenizer as fast

    eos = load_config(Path(folder)).get("eos_token_id")
    ours = fast.load(folder, [eos] if isinstance(eos, int) else list(eos or []))
    assert ours is not None, "the fast path covers this folder"
    return ours, load_tokenizer(Path(folder), eos_token_ids=eos)


def _streamed(tokenizer: Any, ids: list[int]) -> list[str]:
    detokenizer = tokenizer.detokenizer
    pieces = []
    for token in ids:
        detokenizer.add_token(token)
        pieces.append(detokenizer.last_segment)
    detokenizer.finalize()
    return [*pieces, detokenizer.last_segment]


def _whole_at_every_cut(tokenizer: Any) -> None:
    """An answer cut after any token ends at its last whole character: no U+FFFD, a prefix of the whole."""
    from mlxpipe.engine.tokenizer import finalize_whole

    for text in TEXTS:
        ids = tokenizer.encode(text, add_special_tokens=False)
        whole = _streamed(tokenizer, ids)
        full = "".join(whole)
        for cut in range(1, len(ids) + 1):
            detokenizer = tokenizer.detokenizer
            pieces = []
            for token in ids[:cut]:
                detokenizer.add_token(token)
                pieces.append(detokenizer.last_segment)
            finalize_whole(detokenizer)
            answer = "".join([*pieces, detokenizer.last_segment])
            assert "\ufffd" not in answer, (text, cut, answer)
            assert full.startswith(answer), (text, cut, answer)


def _agree(ours: Any, theirs: Any) -> None:
    assert len(ours) == len(theirs)
    assert ours.eos_token_ids == theirs.eos_token_ids
    assert ours.bos_token == theirs.bos_token
    assert ours.has_chat_template == theirs.has_chat_template
    for text in TEXTS:
        for special in (True, False):
            ids = ours.encode(text, add_special_tokens=special)
            assert ids == theirs.encode(text, add_special_tokens=special), (text, special)
        assert _streamed(ours, ids) == _streamed(theirs, ids), text
    for messages in CONVERSATIONS:
        for generation in (True, False):
            kwargs = {"add_generation_prompt": generation}
            text = ours.apply_chat_template(messages, tokenize=False, **kwargs)
            assert text == theirs.apply_chat_template(messages, tokenize=False, **kwargs)
            assert ours.apply_chat_template(messages, **kwargs) == theirs.apply_chat_template(
                messages, **kwargs
            )


@pytest.mark.model
def test_the_embedded_models_tokenizer_answers_as_mlx_lms() -> None:
    ours, theirs = _both(models.materialize(models.resolve(None)))
    _agree(ours, theirs)
    _whole_at_every_cut(ours)
    _whole_at_every_cut(theirs)  # mlx-lm's own detokenizer, for the models our tokenizer leaves to it


def test_a_sentencepiece_tokenizer_answers_as_mlx_lms(tmp_path: Path) -> None:
    pytest.importorskip("gguf")
    path = write_gguf(tmp_path / "spm.gguf", "llama", trained_spm(tmp_path / "spm"))
    folder = tmp_path / "out"
    models.convert_gguf(path, folder)
    ours, theirs = _both(str(folder))
    assert type(ours._detokenizer).__name__ == "_SentencePiece"
    _agree(ours, theirs)
    _whole_at_every_cut(ours)
    _whole_at_every_cut(theirs)


@pytest.mark.model
def test_one_record_runs_without_transformers() -> None:
    # mlx-lm's package imports transformers (most of a second); a one-record run needs none of it.
    code = (
        "import sys\nfrom mlxpipe.cli import main\nstatus = main(['-n', '2'])\n"
        "print(status, sorted(m for m in sys.modules if m.split('.')[0] == 'transformers'), file=sys.stderr)"
    )
    r = subprocess.run(
        [sys.executable, "-c", code], input=b"hi\n", capture_output=True, env=cli_env(), cwd=REPO, timeout=300
    )
    assert r.stderr.decode().strip() == "0 []"
    assert r.stdout.strip()
    # The command itself gives the same answer (its own process, the same path).
    r2 = subprocess.run([*MLXPIPE, "-n", "2"], input=b"hi\n", capture_output=True, env=cli_env(), timeout=300)
    assert r2.returncode == 0 and r2.stdout == r.stdout


def test_mlx_lm_deferred_by_the_engine_is_whole_on_first_use() -> None:
    # The engine registers mlx_lm without running its __init__; the first use of a name it defines runs it.
    code = (
        "import sys, mlxpipe.engine, mlx_lm\n"
        "before = 'transformers' in sys.modules\n"
        "from mlx_lm import stream_generate\n"
        "print(before, callable(stream_generate), callable(mlx_lm.load), mlx_lm.__version__ != '')"
    )
    r = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, env=cli_env(), cwd=REPO, timeout=300
    )
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == [b"False", b"True", b"True", b"True"]
    assert r.stderr == b""  # transformers' advisory lines stay quiet, as under a plain import mlx_lm
