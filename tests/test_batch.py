"""--batch: continuous batching on the real embedded model, and the input-order buffer (issue 6)."""

from __future__ import annotations

import json
import signal
from typing import Any

import pytest
from conftest import cli_env, run_cli, start_cli
from hypothesis import given
from hypothesis import strategies as st

from mlxpipe.events import FINAL_EVENTS, Chunk, Done, Error
from mlxpipe.pipeline import _InputOrder, run
from mlxpipe.records import BadRecord, Record, Settings

PARIS = "What is the capital of France?"
PROMPTS = [PARIS, "Say hello.", "Name three colours.", "What is 2+2?", "Name a fruit."]


def events(stdout: bytes) -> list[dict]:
    return [json.loads(line) for line in stdout.decode().splitlines()]


def finals(evs: list[dict]) -> list[dict]:
    return [e for e in evs if e["event"] in ("done", "error")]


def grouped_in_order(evs: list[dict]) -> bool:
    """Every record's events are contiguous and records follow each other in input order."""
    ids = [e["id"] for e in evs]
    runs = [i for n, i in enumerate(ids) if n == 0 or ids[n - 1] != i]
    return len(runs) == len(set(runs)) and all(e["event"] in ("done", "error") for e in finals(evs))


@pytest.mark.model
def test_batch_matches_sequential_greedy_and_keeps_order(batch_is_exact: bool) -> None:
    lines = "".join(json.dumps({"id": f"r{n}", "prompt": p}) + "\n" for n, p in enumerate(PROMPTS))
    seq = events(run_cli(["--jsonl", "-n", "8", "--batch", "1"], input=lines).stdout)
    r = run_cli(["--jsonl", "-n", "8", "--batch", "4"], input=lines)
    assert r.returncode == 0 and r.stderr == b"", r.stderr
    bat = events(r.stdout)
    assert grouped_in_order(bat)
    assert [e["id"] for e in finals(bat)] == [f"r{n}" for n in range(len(PROMPTS))]
    if batch_is_exact:
        assert [e["text"] for e in finals(bat)] == [e["text"] for e in finals(seq)]
    assert all(e["event"] == "done" and e["text"] for e in finals(bat))
    for done in finals(bat):
        chunks = [e for e in bat if e["id"] == done["id"] and e["event"] == "chunk"]
        assert "".join(c["text"] for c in chunks) == done["text"]
        assert [c["tokens"] for c in chunks] == sorted(c["tokens"] for c in chunks)
        assert done["prompt_tokens"] > 5 and done["tokens"] <= 8 and done["peak_memory"] > 1_000_000
    assert "Paris" in finals(bat)[0]["text"]


@pytest.mark.model
def test_8_bit_activations_give_a_batch_the_answers_of_one_at_a_time() -> None:
    # On a CPU with VNNI the quantized products split activations into 8-bit parts and sum integers:
    # two parts by default, one with MLXPIPE_INT8=1 (llama.cpp's way), none with off. Each record's numbers
    # are its own either way, so --batch (16 rows and more too: a prompt's rows) answers as --batch 1 does.
    def parts(**env: str) -> int:
        info = json.loads(run_cli(["--model-info"], input=b"", env=cli_env(**env)).stdout)
        return int(info["int8_activations"])

    if not parts():
        pytest.skip("no VNNI (or no quantized kernels) here")
    assert (parts(), parts(MLXPIPE_INT8="1"), parts(MLXPIPE_INT8="off")) == (2, 1, 0)
    prompts = [*PROMPTS, *(f"Write one sentence about the number {n}." for n in range(15))]
    lines = "".join(json.dumps({"id": f"r{n}", "prompt": p}) + "\n" for n, p in enumerate(prompts))
    env = cli_env(MLXPIPE_INT8="1")
    one = run_cli(["--jsonl", "--no-stream", "-n", "12", "--batch", "1"], input=lines, env=env)
    many = run_cli(["--jsonl", "--no-stream", "-n", "12", "--batch", "20"], input=lines, env=env)
    assert one.returncode == many.returncode == 0, one.stderr + many.stderr
    single, batched = finals(events(one.stdout)), finals(events(many.stdout))
    assert [e["text"] for e in batched] == [e["text"] for e in single]
    assert all(e["event"] == "done" and e["text"] for e in single)


@pytest.mark.model
def test_batch_auto_is_the_default_off_a_terminal_and_says_what_it_chose(batch_is_exact: bool) -> None:
    info = json.loads(run_cli(["--model-info"], input=b"").stdout)
    assert info["batch"]["auto"] and info["batch"]["size"] > 1 and info["batch"]["reason"]
    lines = "".join(json.dumps({"id": f"r{n}", "prompt": p}) + "\n" for n, p in enumerate(PROMPTS))
    auto = run_cli(["--jsonl", "-n", "8", "--stats"], input=lines)
    one = run_cli(["--jsonl", "-n", "8", "--stats", "--batch", "1"], input=lines)
    assert auto.returncode == one.returncode == 0, auto.stderr + one.stderr
    assert f"batch {info['batch']['size']} (auto: {info['batch']['reason']})" in auto.stderr.decode()
    assert one.stderr.decode().rstrip().endswith(", batch 1")
    batched, single = finals(events(auto.stdout)), finals(events(one.stdout))
    assert [e["id"] for e in batched] == [f"r{n}" for n in range(len(PROMPTS))]
    if batch_is_exact:
        assert [e["text"] for e in batched] == [e["text"] for e in single]


@pytest.mark.model
def test_batch_per_record_stop_max_tokens_and_bad_records() -> None:
    lines = [
        json.dumps({"id": "long", "prompt": "Write a long story about a dragon.", "max_tokens": 3}),
        '{"id": "broken", "prompt": ',
        json.dumps({"id": "cut", "prompt": PARIS, "stop": ["Paris."]}),
        json.dumps({"id": "huge", "prompt": "word " * 9000}),  # longer than the model's context
        json.dumps({"id": "free", "prompt": PARIS}),
    ]
    r = run_cli(["--jsonl", "-n", "20", "--batch", "8"], input="\n".join(lines) + "\n")
    assert r.returncode == 1  # two records failed, the others were done
    evs = events(r.stdout)
    assert grouped_in_order(evs)
    out = finals(evs)
    assert [e["id"] for e in out] == ["long", 2, "cut", "huge", "free"]
    assert [e["event"] for e in out] == ["done", "error", "done", "error", "done"]
    assert out[0]["finish_reason"] == "length" and out[0]["tokens"] == 3
    assert out[1]["line"] == 2 and "invalid json" in out[1]["error"].lower()
    assert out[2]["finish_reason"] == "stop" and out[2]["text"] == "The capital of France is "
    assert "Par" not in "".join(e["text"] for e in evs if e["id"] == "cut" and e["event"] == "chunk")
    assert out[3]["line"] == 4 and "context" in out[3]["error"]
    assert out[4]["finish_reason"] == "stop" and "Paris." in out[4]["text"]
    err = [e for e in r.stderr.decode().splitlines() if e.startswith("mlxpipe:")]
    assert [e.split(":")[:2] for e in err] == [["mlxpipe", " error (at <stdin>"]] * 2


@pytest.mark.model
def test_unordered_ids_are_complete() -> None:
    recs = [{"id": n, "prompt": p, "max_tokens": 12 if n == 0 else 2} for n, p in enumerate(PROMPTS)]
    r = run_cli(["--jsonl", "--batch", "3", "--unordered"], input="".join(json.dumps(x) + "\n" for x in recs))
    assert r.returncode == 0, r.stderr
    evs = events(r.stdout)
    out = finals(evs)
    assert sorted(e["id"] for e in out) == list(range(len(PROMPTS)))
    assert out[-1]["id"] == 0  # the long first record finished after the short ones behind it
    for done in out:
        assert (
            "".join(e["text"] for e in evs if e["id"] == done["id"] and e["event"] == "chunk") == done["text"]
        )


def test_unordered_needs_jsonl_output() -> None:
    r = run_cli(["--batch", "2", "--unordered"], input="hi\n")
    assert r.returncode == 2 and b"--unordered needs JSONL output" in r.stderr


@pytest.mark.model
def test_seeded_sampling_does_not_depend_on_batch_neighbours(batch_is_exact: bool) -> None:
    if not batch_is_exact:
        pytest.skip("16-bit GPU math: a row's logits round differently beside other rows (conftest)")
    prompt = "Invent a name for a cat."
    args = ["--out", "jsonl", "--no-stream", "--temp", "1.0", "--seed", "7", "-n", "6"]
    batched = events(run_cli([*args, "--batch", "4"], input=f"Say something.\n{prompt}\n{prompt}\n").stdout)
    alone = events(run_cli(args, input=f"{prompt}\n").stdout)
    assert batched[1]["text"] == batched[2]["text"] == alone[0]["text"]


@pytest.mark.model
def test_sigint_interrupts_every_record_in_flight_in_order() -> None:
    p = start_cli(["--jsonl", "-n", "200", "--batch", "4"])
    assert p.stdin and p.stdout and p.stderr
    p.stdin.write(b'"Write a long story about a dragon."\n"Tell me about the sea."\n"Describe a forest."\n')
    p.stdin.flush()  # stdin stays open: the records in flight must not wait for more input
    first = p.stdout.readline()
    assert json.loads(first)["event"] == "chunk"
    p.send_signal(signal.SIGINT)
    rest = p.stdout.read()
    p.wait(timeout=60)
    p.stdin.close()
    assert p.returncode == -signal.SIGINT  # the process ends by the signal, as a shell expects
    assert p.stderr.read() == b"mlxpipe: interrupted after 3 records (3 cut short)\n"
    evs = events(first + rest)
    out = finals(evs)
    assert [e["id"] for e in out] == [1, 2, 3]
    assert [e["finish_reason"] for e in out] == ["interrupted"] * 3
    assert grouped_in_order(evs)
    assert p.stderr.read() == b""


@pytest.mark.model
def test_shared_prefix_reuse_gives_the_same_answers() -> None:
    system = "You are a terse geography assistant. " * 6
    args = ["--out", "jsonl", "--no-stream", "-n", "8", "--system", system]
    text = f"{PARIS}\nWhat is the capital of Italy?\n"
    reused = events(run_cli([*args, "--batch", "2"], input=text).stdout)
    plain = events(run_cli([*args, "--no-prefix-cache"], input=text).stdout)
    kept = events(run_cli(args, input=text).stdout)  # the prefix's KV cache read from the first run's file
    assert [e["text"] for e in reused] == [e["text"] for e in plain] == [e["text"] for e in kept]
    assert reused[0]["prompt_tokens"] == plain[0]["prompt_tokens"] > 60


# ---------------------------------------------------------------------------------------------
# The ordering buffer alone (no model)


@given(st.lists(st.integers(min_value=0, max_value=4), min_size=1, max_size=5), st.randoms())
def test_input_order_regroups_any_interleaving(lengths: list[int], rnd) -> None:
    streams = []
    for index, n in enumerate(lengths, 1):
        chunks = [Chunk(index, index, f"{index}.{k}", k, 1.0) for k in range(n)]
        end = (
            Error(index, index, "f", index, "bad")
            if n == 0
            else Done(index, index, "", "stop", n, 1, 1, 1, 1, None)
        )
        streams.append([*chunks, end])
    order = _InputOrder()
    for index in range(1, len(lengths) + 1):
        order.admit(index)
    out = []
    cursors = [0] * len(streams)
    while any(c < len(s) for c, s in zip(cursors, streams, strict=True)):  # random interleaving
        i = rnd.choice([i for i, s in enumerate(streams) if cursors[i] < len(s)])
        out.extend(order.push(streams[i][cursors[i]]))
        cursors[i] += 1
    assert out == [e for s in streams for e in s]
    assert len(order) == 0


# ---------------------------------------------------------------------------------------------
# The batched scheduler with a stand-in batch (no model): read-ahead bound and interrupts


class _WordBatch:
    """Answers each record with its prompt's words, one word per step, like a batch of real records."""

    def __init__(self, size: int) -> None:
        self.size = size
        self.slots: dict[int, tuple[Record, list[str]]] = {}
        self.max_in_flight = 0

    def __len__(self) -> int:
        return len(self.slots)

    def add(self, record: Record) -> None:
        self.slots[record.index] = (record, (record.prompt or "").split())
        self.max_in_flight = max(self.max_in_flight, len(self.slots))

    def step(self) -> list[Chunk | Done]:
        out: list[Chunk | Done] = []
        for index, (record, words) in list(self.slots.items()):
            out.append(Chunk(index, record.id, words.pop(0), 1, 1.0))
            if not words:
                out.append(Done(index, record.id, "", "stop", 1, 1.0, 1, 1.0, 1, None))
                del self.slots[index]
        return out

    def interrupt(self) -> list[Chunk | Done]:
        out: list[Chunk | Done] = [
            Done(i, r.id, "", "interrupted", 0, 0.0, 1, 1.0, 1, None)
            for i, (r, _) in sorted(self.slots.items())
        ]
        self.slots.clear()
        return out

    def close(self) -> None:
        self.slots.clear()


class _WordEngine:
    def __init__(self) -> None:
        self.batches: list[_WordBatch] = []

    def batch(self, size: int) -> _WordBatch:
        self.batches.append(_WordBatch(size))
        return self.batches[-1]


class _LoneEngine(_WordEngine):
    """Answers one record at a time as well, noting which."""

    def __init__(self) -> None:
        super().__init__()
        self.alone: list[int] = []

    def generate(self, record: Record, should_stop: Any = None) -> Any:
        self.alone.append(record.index)
        yield Done(record.index, record.id, "w", "stop", 1, 0.0, 1, 0.0, 0, record.input)


def test_a_lone_record_is_answered_without_a_batch() -> None:
    # --batch auto is 16 on a CPU: an input of one record must not pay for setting a batch up.
    def records(n: int) -> list[Record]:
        return [Record(i, "<t>", i, i, None, Settings(), prompt="w w") for i in range(1, n + 1)]

    engine = _LoneEngine()
    assert [e.kind for e in run(records(1), engine, batch=4)] == ["done"]  # type: ignore[arg-type]
    assert engine.alone == [1] and engine.batches == []
    engine = _LoneEngine()
    ends = [e.index for e in run(records(2), engine, batch=4) if isinstance(e, FINAL_EVENTS)]  # type: ignore[arg-type]
    assert ends == [1, 2] and engine.alone == [] and len(engine.batches) == 1


def test_batched_run_orders_events_and_bounds_read_ahead() -> None:
    pulled = 0

    def endless():  # an input that never ends: memory must not grow with it
        nonlocal pulled
        while True:
            pulled += 1
            words = "w " * (1 + (pulled * 7) % 5)
            if pulled % 4 == 0:
                yield BadRecord(pulled, "<t>", pulled, pulled, "bad")
            else:
                yield Record(pulled, "<t>", pulled, pulled, None, Settings(), prompt=words)

    engine = _WordEngine()
    out = []
    for event in run(endless(), engine, batch=3):  # type: ignore[arg-type]
        out.append(event)
        if isinstance(event, FINAL_EVENTS) and event.index == 200:
            break
    ends = [e.index for e in out if isinstance(e, FINAL_EVENTS)]
    assert ends == list(range(1, 201))
    assert [e.kind for e in out if e.index == 8] == ["error"]
    assert engine.batches[0].max_in_flight == 3
    assert pulled <= 200 + 3 * 3 + 2  # in flight, held for order, queued (plus one in the reader's hand)


def test_batched_run_interrupts_every_record_in_flight() -> None:
    records = [Record(n, "<t>", n, n, None, Settings(), prompt="w " * 50) for n in range(1, 6)]
    engine = _WordEngine()
    steps = 0

    def should_stop() -> bool:
        nonlocal steps
        steps += 1
        return steps > 20

    out = list(run(records, engine, should_stop, batch=4))  # type: ignore[arg-type]
    dones = [e for e in out if isinstance(e, Done)]
    assert [d.index for d in dones] == [1, 2, 3, 4]  # the fifth record was never started
    assert {d.finish_reason for d in dones} == {"interrupted"}
    indices = [e.index for e in out]
    assert indices == sorted(indices)


@pytest.mark.model
def test_logits_processors_see_the_whole_prompt_when_a_prefix_is_reused(engine, monkeypatch) -> None:
    # A repetition penalty looks back over the prompt: with the shared prefix's KV cache reused, the
    # sequential path must still show it every prompt token, as the batched path does (all_tokens).
    from dataclasses import replace

    from mlxpipe.reader import records_from_objects

    seen: list[list[int]] = []

    def record_tokens(tokens: Any, logits: Any) -> Any:
        seen.append(tokens.tolist())
        return logits

    monkeypatch.setattr(engine, "processors_for", lambda record: [record_tokens])
    (rec,) = records_from_objects([PARIS])
    rec = replace(rec, settings=replace(rec.settings, system="You are terse. " * 8, max_tokens=2))
    prompt = engine.encode(rec)
    for _ in range(2):  # the second time, the system prompt's KV cache is reused
        seen.clear()
        assert [type(e).__name__ for e in engine.generate(rec)][-1] == "Done"
        assert seen[0][: len(prompt)] == prompt
    assert engine.prefix_for(rec, prompt)[0] > 16  # the prefix really was cached


@pytest.mark.model
def test_prompts_are_read_in_chunks_of_the_backends_prefill_step(engine, monkeypatch) -> None:
    # On a CPU, mlx's attention fallback scores every pair of a chunk, masked ones too: 256-token chunks
    # read long prompts faster than mlx-lm's 2048 (bench/prefill.py). Both paths get the same step.
    import mlx.core as mx

    from mlxpipe.engine import sequential as engine_module
    from mlxpipe.reader import records_from_objects

    assert engine.prefill_step == (256 if mx.default_device() == mx.cpu else 2048)
    seen: dict[str, Any] = {}
    real = engine_module.stream_generate

    def spy(*args: Any, **kwargs: Any) -> Any:
        seen.update(kwargs)
        return real(*args, **kwargs)

    monkeypatch.setattr(engine_module, "stream_generate", spy)
    (rec,) = records_from_objects([PARIS], Settings(max_tokens=1))
    assert [type(e).__name__ for e in engine.generate(rec)][-1] == "Done"
    assert seen["prefill_step_size"] == engine.prefill_step
    batch = engine.batch(2)
    try:
        assert batch._gen.prefill_step_size == engine.prefill_step
    finally:
        batch.close()


def test_batch_auto_size_is_the_backends_unless_the_kv_caches_would_not_fit() -> None:
    from types import SimpleNamespace

    from mlxpipe.engine.batch import AUTO_CPU, AUTO_GPU, auto_size

    # SmolLM2-135M's shape: 30 layers, 3 KV heads of 64 values: 46,080 bytes a token in float32.
    shape = {"num_hidden_layers": 30, "num_key_value_heads": 3, "hidden_size": 576, "num_attention_heads": 9}
    model = SimpleNamespace(args=SimpleNamespace(**shape))
    per_record = 46_080 * (64 + 512)
    assert auto_size(model, 64, 10**12, on_gpu=False) == (AUTO_CPU, "the size for a CPU")
    assert auto_size(model, 64, 10**12, on_gpu=True)[0] == AUTO_GPU
    size, why = auto_size(model, 64, 2 * 5 * per_record, on_gpu=False)
    assert size == 5 and "5 records fit in half the free memory" in why
    assert auto_size(model, 64, 1, on_gpu=False)[0] == 1  # never less than one
    assert auto_size(object(), 64, 1, on_gpu=False)[0] == AUTO_CPU  # shape unknown: the backend's size
    assert auto_size(model, 64, None, on_gpu=False)[0] == AUTO_CPU  # free memory unknown


@pytest.mark.model
def test_greedy_batches_skip_the_log_softmax_and_pick_mlx_lms_tokens(engine, monkeypatch) -> None:
    # A greedy batch's decode steps take the argmax of the logits: no log-softmax over the vocabulary (no
    # event carries log-probabilities), the same tokens as mlx-lm's own step. A sampled record in the batch
    # puts every step back on mlx-lm's.
    import mlx.core as mx

    from mlxpipe.engine import batch as batch_module
    from mlxpipe.reader import records_from_objects

    calls: list[int] = []
    real = mx.logsumexp

    def counted(*args: Any, **kwargs: Any) -> Any:
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(mx, "logsumexp", counted)

    def answers(sampled: bool) -> tuple[list[str], int]:
        calls.clear()
        objects: list[Any] = [{"prompt": p} for p in PROMPTS[:3]]
        objects += [{"prompt": PROMPTS[3], "temperature": 1.0, "seed": 3}] * sampled
        records = records_from_objects(objects, Settings(max_tokens=8))
        texts = [e.text for e in run(records, engine, batch=4) if isinstance(e, Done)]
        return texts, len(calls)

    monkeypatch.setattr(batch_module, "GREEDY_ARGMAX", False)
    plain, plain_calls = answers(sampled=False)
    monkeypatch.setattr(batch_module, "GREEDY_ARGMAX", True)
    greedy, greedy_calls = answers(sampled=False)
    assert greedy == plain and all(greedy)
    assert plain_calls >= 7 and greedy_calls <= 3  # only each record's first token, at the end of its prompt
    mixed, mixed_calls = answers(sampled=True)
    assert mixed[:3] == greedy and mixed_calls >= 7


def test_cpu_batch_caches_roll_only_their_filled_positions_to_mlx_lms_result() -> None:
    # A right-padded prefill into a cache with history (a reused prefix), then the roll that right-justifies
    # each row: mlx-lm rolls the whole buffer; the tuned cache rolls the filled positions, with the same keys
    # and values wherever a row attends (the greedy tests above check the answers through the real model).
    import mlx.core as mx
    from mlx_lm.models.cache import BatchKVCache, KVCache, dynamic_roll

    from mlxpipe.engine import batch

    batch._tune_cpu_caches()
    assert BatchKVCache.step == batch.CPU_KV_STEP
    rows, heads, dim, lengths = 3, 2, 4, [5, 3, 4]
    prefix = []
    for n in (2, 6, 4):  # history of unequal lengths: merged left-padded
        c = KVCache()
        c.update_and_fetch(mx.random.normal((1, heads, n, dim)), mx.random.normal((1, heads, n, dim)))
        prefix.append(c)
    cache = BatchKVCache.merge(prefix)
    padding = [max(lengths) - n for n in lengths]
    cache.prepare(lengths=lengths, right_padding=padding)
    cache.update_and_fetch(*(mx.random.normal((rows, heads, max(lengths), dim)) for _ in range(2)))
    assert cache.keys.shape[2] > cache._idx  # a buffer with room past the filled positions
    shifts = mx.array(padding)[:, None]
    want = [dynamic_roll(a, shifts, axis=2)[..., : cache._idx, :] for a in (cache.keys, cache.values)]
    cache.finalize()
    got = cache.keys_and_values()
    pads = cache.left_padding.tolist()
    assert pads == [4 + 0, 0 + 2, 2 + 1]  # history's padding, then the roll's
    # Every position a row attends to is the same; the padding before (masked, never read) may differ.
    for g, w in zip(got, want, strict=True):
        assert all(mx.array_equal(g[i, :, p:], w[i, :, p:]).item() for i, p in enumerate(pads))


@pytest.mark.model
def test_rows_of_ended_records_are_taken_by_later_ones_with_unchanged_answers(
    engine, monkeypatch, batch_is_exact: bool
) -> None:
    # A record that ends leaves its row to the next record (no copy of every KV cache as it leaves and as
    # the next joins); the common left padding is cut (here after 4 positions, to see it happen). Each
    # record's answer is what it gets alone, whatever row it took; a stop string frees a row too.
    from mlxpipe.engine import batch as batch_module
    from mlxpipe.reader import records_from_objects

    cls = batch_module._greedy_batch()
    counts = {"placed": 0, "cut": 0}
    place, cut = cls._place, cls._drop_common_padding

    def placed(self: Any, *args: Any) -> None:
        counts["placed"] += 1
        place(self, *args)

    def cutting(self: Any) -> None:
        before = self.prompt_cache[0]._idx
        cut(self)
        counts["cut"] += self.prompt_cache[0]._idx < before

    monkeypatch.setattr(cls, "_place", placed)
    monkeypatch.setattr(cls, "_drop_common_padding", cutting)
    monkeypatch.setattr(cls, "PADDING_CUT", 4)
    # A wave of records reads its prompts' last tokens in the decoding batch's next step, not in a step
    # of its own (mlx-lm's GenerationBatch steps as it is made: a model call per wave).
    from mlx_lm.generate import GenerationBatch

    own_steps = {"n": 0}
    base_step = GenerationBatch._step

    def own_step(self: Any) -> Any:
        own_steps["n"] += 1
        return base_step(self)

    monkeypatch.setattr(GenerationBatch, "_step", own_step)
    objects: list[Any] = [{"prompt": p, "max_tokens": 2 + n % 5} for n, p in enumerate(PROMPTS * 2)]
    objects[3]["stop"] = [" "]
    records = list(records_from_objects(objects, Settings()))
    alone = [e for e in run(iter(records), engine, batch=1) if isinstance(e, Done)]
    together = [e for e in run(iter(records), engine, batch=3) if isinstance(e, Done)]
    assert [e.index for e in together] == [r.index for r in records]
    assert counts["placed"] >= 3 and counts["cut"] >= 1
    assert own_steps["n"] == 0  # every step was the decoding batch's (greedy: its argmax step)
    assert all(0 < e.tokens <= o["max_tokens"] for e, o in zip(together, objects, strict=True))
    if batch_is_exact:
        assert [(e.text, e.tokens) for e in together] == [(e.text, e.tokens) for e in alone]
