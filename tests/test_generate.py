"""The engine's own generate loop (mlxpipe/engine/generate.py) makes what mlx-lm's ``stream_generate`` makes:
the same tokens, text segments and finish reasons, greedy and sampled, with processors and a reused prefix."""

from __future__ import annotations

from typing import Any

import pytest

pytestmark = pytest.mark.model


def _both(engine: Any, tokens: list[int], **kwargs: Any) -> tuple[list[Any], list[Any]]:
    """Our responses and mlx-lm's for the same arguments, each run from the same global seed."""
    import mlx.core as mx
    import mlx_lm

    from mlxpipe.engine.generate import stream_generate

    runs = []
    for generate, tokenizer in (
        (stream_generate, engine.tokenizer),
        (mlx_lm.stream_generate, _theirs(engine)),
    ):
        mx.random.seed(7)
        responses = generate(engine.model, tokenizer, tokens, prefill_step_size=8, **kwargs)
        runs.append([(r.text, r.token, r.generation_tokens, r.finish_reason) for r in responses])
    return runs[0], runs[1]


def test_greedy_tokens_and_text_match_mlx_lm(engine: Any) -> None:
    from mlx_lm.sample_utils import make_logits_processors, make_sampler

    tokens = engine.prompts.tokens(_record("What is the capital of France? Answer in one sentence."))
    for max_tokens in (1, 5, 40):
        kwargs = {"max_tokens": max_tokens, "sampler": make_sampler(0.0), "logits_processors": []}
        ours, theirs = _both(engine, tokens, **kwargs)
        assert ours == theirs and ours
    # a repetition penalty sees the prompt (read in chunks of 8) and every token since
    processors = make_logits_processors(repetition_penalty=1.3)
    ours, theirs = _both(
        engine, tokens, max_tokens=24, sampler=make_sampler(0.0), logits_processors=processors
    )
    assert ours == theirs
    assert ours[-1][3] in ("stop", "length")


def test_sampled_tokens_match_mlx_lm_from_the_same_seed(engine: Any) -> None:
    from mlx_lm.sample_utils import make_sampler

    tokens = engine.prompts.tokens(_record("Write a word."))
    sampler = make_sampler(0.9, top_p=0.95)  # draws from mlx's global key, seeded alike for both
    ours, theirs = _both(engine, tokens, max_tokens=16, sampler=sampler, logits_processors=[])
    assert ours == theirs


def test_a_reused_prefix_cache_gives_mlx_lms_tokens(engine: Any) -> None:
    import mlx_lm
    from mlx_lm.models.cache import make_prompt_cache
    from mlx_lm.sample_utils import make_sampler

    from mlxpipe.engine.generate import stream_generate
    from mlxpipe.engine.prefix import prefill

    tokens = engine.prompts.tokens(_record("Name three colours."))
    runs = []
    for generate, tokenizer in (
        (stream_generate, engine.tokenizer),
        (mlx_lm.stream_generate, _theirs(engine)),
    ):
        cache = make_prompt_cache(engine.model)
        prefill(engine.model, cache, tokens[:20], step=256)
        responses = generate(
            engine.model,
            tokenizer,
            tokens[20:],
            max_tokens=12,
            sampler=make_sampler(0.0),
            logits_processors=[],
            prompt_cache=cache,
        )
        runs.append([(r.text, r.token, r.finish_reason) for r in responses])
    assert runs[0] == runs[1]


def test_a_prefix_kept_between_runs_is_read_back_bit_for_bit(engine: Any, tmp_path: Any, monkeypatch) -> None:
    import mlx.core as mx

    from mlxpipe.engine import prefix

    tokens = engine.prompts.tokens(_record("Name three colours."))
    files = {}

    def store(key: tuple[int, ...]) -> Any:
        return files.setdefault(key, tmp_path / f"m.prefix-{len(files)}.safetensors")

    n, computed = prefix.PrefixCache(engine.model, 256, store).split(tokens[:20], tokens)
    (path,) = files.values()
    assert n == 20 and path.is_file()
    monkeypatch.setattr(prefix, "prefill", lambda *a, **k: pytest.fail("computed again"))
    n, kept = prefix.PrefixCache(engine.model, 256, store).split(tokens[:20], tokens)
    assert n == 20 and computed is not None and kept is not None
    for a, b in zip(computed, kept, strict=True):
        assert a.offset == b.offset == 20
        assert mx.array_equal(a.keys, b.keys).item() and mx.array_equal(a.values, b.values).item()


def test_a_damaged_or_foreign_prefix_file_is_computed_again(engine: Any, tmp_path: Any) -> None:
    import mlx.core as mx

    from mlxpipe.engine import prefix

    tokens = engine.prompts.tokens(_record("Name three colours."))
    path = tmp_path / "m.prefix-0.safetensors"
    fresh = prefix.PrefixCache(engine.model, 256).split(tokens[:20], tokens)[1]
    for content in (b"not a safetensors file", None):
        if content is None:  # a well-formed file of another length: refused, not sliced
            mx.save_safetensors(
                str(path), {"0.keys": mx.zeros((1, 3, 5, 64)), "0.values": mx.zeros((1, 3, 5, 64))}
            )
        else:
            path.write_bytes(content)
        n, cache = prefix.PrefixCache(engine.model, 256, lambda _: path).split(tokens[:20], tokens)
        assert n == 20 and cache is not None and fresh is not None
        assert all(mx.array_equal(a.keys, b.keys).item() for a, b in zip(fresh, cache, strict=True))
        assert mx.load(str(path))["0.keys"].shape[2] == 20  # rewritten with what was computed


def test_prefix_files_beyond_the_kept_number_are_dropped_oldest_first(engine: Any, tmp_path: Any) -> None:
    import os

    from mlxpipe.engine import prefix

    tokens = engine.prompts.tokens(_record("Name three colours."))
    for i in range(prefix.PREFIX_FILES_KEPT + 2):
        old = tmp_path / f"m.prefix-old{i}.safetensors"
        old.write_bytes(b"x")
        os.utime(old, (1000 + i, 1000 + i))
    new = tmp_path / "m.prefix-new.safetensors"
    prefix.PrefixCache(engine.model, 256, lambda _: new).split(tokens[:20], tokens)
    left = sorted(p.name for p in tmp_path.glob("m.prefix-*"))
    assert len(left) == prefix.PREFIX_FILES_KEPT and new.name in left
    assert (
        "m.prefix-old0.safetensors" not in left
        and f"m.prefix-old{prefix.PREFIX_FILES_KEPT + 1}.safetensors" in left
    )


def _record(text: str) -> Any:
    from mlxpipe.reader import records_from_objects

    (record,) = records_from_objects([text])
    return record


def _theirs(engine: Any) -> Any:
    """mlx-lm's own tokenizer wrapper for the engine's model folder."""
    from pathlib import Path

    from mlx_lm.tokenizer_utils import load

    return load(Path(engine.folder), eos_token_ids=sorted(engine.tokenizer.eos_token_ids))


def test_a_conversation_computes_only_each_turns_new_tokens(engine: Any, monkeypatch: Any) -> None:
    # --chat: each turn's shared head is the whole conversation so far. It begins with the last turn's head,
    # whose KV cache is reused: only the last question, its answer and the template's marks are computed.
    from mlxpipe.cli.interactive import Conversation
    from mlxpipe.engine import prefix
    from mlxpipe.pipeline import run
    from mlxpipe.reader import records_from_objects
    from mlxpipe.records import Settings

    computed: list[tuple[int, int]] = []
    real = prefix.prefill

    def counting(model: Any, cache: Any, tokens: Any, *, step: int, start: int = 0) -> None:
        computed.append((len(tokens), start))
        real(model, cache, tokens, step=step, start=start)

    monkeypatch.setattr(prefix, "prefill", counting)
    monkeypatch.setattr(engine.prefixes, "store", None)  # no file kept from another test: computed here

    def converse() -> list[str]:
        engine.prefixes.clear()
        conversation = Conversation()
        turns = ["My name is Bob. Remember it.", "What is my name?", "Say it again."]
        answers = []
        for event in run(conversation.turns(records_from_objects(turns, Settings(max_tokens=8))), engine):
            conversation.saw(event)
            if event.kind == "done":
                answers.append(event.text)
        return answers

    answers = converse()
    heads = [length for length, _ in computed]
    assert len(computed) == 3 and heads == sorted(heads) and computed[0][1] == 0
    for (_, start), (before, _) in zip(computed[1:], computed, strict=False):
        assert start == before  # computed from the last turn's head on, not from the start
    # The same answers as with every head computed whole.
    computed.clear()
    monkeypatch.setattr(prefix.PrefixCache, "_longest_within", lambda self, key: (0, None))
    assert converse() == answers
    assert all(start == 0 for _, start in computed)
