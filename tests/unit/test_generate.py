"""app/runtime: sampling, incremental text, stop strings, limits (a stream's `Decoding`), the
decode loop (streams stepped together, leaving, failing); and the exported KV-cache graph
(app/tasks/lm/export.py) of a tiny random GPT against torch."""

from __future__ import annotations

import asyncio
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from app import hooks
from app.data.text_files import train_tokenizer
from app.export.quantize import quantize_weight_only
from app.models.gpt import GPT
from app.runtime import artifact as art
from app.runtime.decoding import (
    DRAW_BLOCK,
    Decoding,
    Generator,
    PromptError,
    SamplingParams,
    nucleus,
    sample,
    sample_rows,
    top_tokens,
)
from app.runtime.kv import KVDecoder, greedy, prefill
from app.tasks.lm.export import (
    HeldOut,
    decode_parity,
    export_kv_onnx,
    greedy_agreement,
    perplexity,
)

pytestmark = pytest.mark.unit

TEXTS = ["def add(a, b):\n    return a + b\n", "# café, naïve, 10 € ✓\n", "print('hello world')\n"]


@pytest.fixture(scope="module")
def tokenizer():
    # A small vocabulary leaves the multi-byte characters split over byte tokens.
    return train_tokenizer(TEXTS * 3, vocab_size=280)


class ScriptedSession:
    """An ONNX Runtime session stand-in that 'predicts' a fixed token sequence: the logits of
    step n put all mass on script[n]. Counts its runs and the tokens it was fed."""

    def __init__(self, script: list[int], vocab: int, layers: int = 1):
        self.script, self.vocab, self.layers = script, vocab, layers
        self.runs, self.fed = 0, []

    def get_inputs(self):
        cache = [
            SimpleNamespace(name=f"past_{k}_{i}", shape=["batch", 2, "past", 4])
            for i in range(self.layers)
            for k in ("key", "value")
        ]
        # position_ids and attention_mask are ignored
        names = ("input_ids", "position_ids", "attention_mask", "logit_positions")
        return [*(SimpleNamespace(name=n, shape=["batch", "tokens"]) for n in names), *cache]

    def get_outputs(self):
        return [SimpleNamespace(name="logits", shape=["batch", "tokens", self.vocab])]

    def run(self, outputs, feed):
        ids = feed["input_ids"]
        self.fed.append(ids[0].tolist())
        logits = np.zeros((1, ids.shape[1], self.vocab), dtype=np.float32)
        logits[0, -1, self.script[min(self.runs, len(self.script) - 1)]] = 10.0
        self.runs += 1
        grow = np.zeros((1, 2, ids.shape[1], 4), dtype=np.float32)
        presents = [np.concatenate([feed[n], grow], axis=2) for n in sorted(feed) if "past" in n]
        picked = feed["logit_positions"]  # the positions whose logits the graph returns
        return [np.take_along_axis(logits, picked[..., None], axis=1), *presents]


def scripted(tokenizer, text: str, block_size: int = 64, **kwargs):
    script = tokenizer.encode(text, add_special_tokens=False).ids
    session = ScriptedSession(script, tokenizer.get_vocab_size())
    return Generator(session, tokenizer, block_size, end_ids(tokenizer), **kwargs), session, script


def end_ids(tokenizer) -> list[int]:
    return [tokenizer.token_to_id("<|endoftext|>")]


class Stepped:
    """One stream's `Decoding` driven by its model's steps, piece by piece: what the decode loop
    does for each of its streams (the tests of text, stops and limits read every piece)."""

    def __init__(self, generator, prompt, params):
        decoder = generator.decoder
        self.decoding = decoding = Decoding(generator, prompt, params)
        self.pieces, self.logprobs = [], []
        logits, caches = prefill(decoder, [prompt])
        self._took(decoding.take(logits[0]))
        cache = caches[0]
        while decoding.finish_reason is None:
            step, cache = decoder.step(np.asarray([[decoding.token]]), cache)
            self._took(decoding.take(step[0, -1]))

    def _took(self, pieces):
        for i, piece in enumerate(pieces):
            self.pieces.append(piece)
            self.logprobs.append(self.decoding.pop_logprobs() if i == 0 else ())

    def text(self):
        return "".join(self.pieces)

    @property
    def finish_reason(self):
        return self.decoding.finish_reason

    @property
    def completion_tokens(self):
        return self.decoding.tokens


def alone(generator, prompt, params):
    """(text, finish reason, tokens, logprobs) of one stream in a decode loop of its own: the
    answer a stream gets with no batch mates."""
    from app.runtime.decode_loop import DecodeLoop

    async def run():
        loop = DecodeLoop(generator)
        result = await read(loop.submit(prompt, params))
        loop.close()
        return result

    return asyncio.run(run())


GREEDY = SamplingParams(max_tokens=64, temperature=0)


def test_multibyte_characters_come_out_whole(tokenizer):
    text = "café 10 € ✓"
    generator, _, script = scripted(tokenizer, text)
    # é, € and ✓ span several byte tokens: decoded alone, those are incomplete characters.
    assert sum("\ufffd" in tokenizer.decode([i]) for i in script) >= 3
    pieces = Stepped(generator, [1], SamplingParams(max_tokens=len(script), temperature=0)).pieces
    assert "".join(pieces) == text
    assert all("\ufffd" not in p for p in pieces)
    assert len(pieces) > 1  # streamed, not one blob at the end


def test_logprobs_name_each_token_its_bytes_and_the_likeliest_alternatives(tokenizer):
    """Every generated token is reported once, with the piece its text went out in; the bytes of
    the byte tokens that split a character add up to the character."""
    text = "café 10 € ✓"
    generator, _, script = scripted(tokenizer, text)
    params = SamplingParams(max_tokens=len(script), temperature=0, logprobs=2)
    generation = Stepped(generator, [1], params)
    tokens = []
    for piece, logprobs in zip(generation.pieces, generation.logprobs, strict=True):
        assert logprobs, f"the piece {piece!r} came without its tokens"
        tokens += logprobs
    assert len(tokens) == len(script)
    assert bytes(b for t in tokens for b in t.bytes) == text.encode()
    # The scripted model puts logit 10 on its token and 0 on each other one.
    expected = 10 - np.log(np.exp(10) + tokenizer.get_vocab_size() - 1)
    for t in tokens:
        assert t.logprob == pytest.approx(expected)
        assert len(t.top) == 2 and (t.top[0][0], t.top[0][2]) == (t.token, t.logprob)
        assert t.top[1][2] < t.logprob
    # Penalties change what is sampled, not what the model said: repeated tokens keep theirs.
    generator, _, script = scripted(tokenizer, "ab ab ab ab ab ab")
    assert len(set(script)) < len(script)
    penalized = SamplingParams(
        max_tokens=len(script), temperature=0, logprobs=0, frequency_penalty=1, presence_penalty=1
    )
    generation = Stepped(generator, [1], penalized)
    assert [t.logprob for p in generation.logprobs for t in p] == pytest.approx(
        [expected] * len(script)
    )


def test_stop_string_cuts_the_text_and_never_streams_part_of_it(tokenizer):
    generator, session, _ = scripted(tokenizer, "print('hello world')\nreturn a")
    generation = Stepped(
        generator, [1], SamplingParams(max_tokens=64, temperature=0, stop=("\nret",))
    )
    pieces = generation.pieces
    assert "".join(pieces) == "print('hello world')"
    assert generation.finish_reason == "stop"
    assert not any("\n" in p for p in pieces)  # the held-back start of the stop string
    assert session.runs == generation.completion_tokens  # no step after the stop


def test_max_tokens_and_the_context_window_bound_a_generation(tokenizer):
    generator, session, _ = scripted(tokenizer, "def add(a, b):\n    return a + b\n")
    generation = Stepped(generator, [1, 2], SamplingParams(max_tokens=5, temperature=0))
    assert (generation.completion_tokens, generation.finish_reason) == (5, "length")
    assert session.runs == 5  # the prompt once, then one step per token but the last
    assert session.fed[0] == [1, 2] and all(len(f) == 1 for f in session.fed[1:])
    short, _, _ = scripted(tokenizer, "def add(a, b):\n    return a + b\n", block_size=6)
    bounded = Stepped(short, [1, 2, 3, 4], SamplingParams(max_tokens=50, temperature=0))
    assert (bounded.completion_tokens, bounded.finish_reason) == (2, "length")


def test_end_of_text_token_stops_with_reason_stop(tokenizer):
    eos = tokenizer.token_to_id("<|endoftext|>")
    ids = tokenizer.encode("a + b", add_special_tokens=False).ids
    session = ScriptedSession([*ids, eos, *ids], tokenizer.get_vocab_size())
    generation = Stepped(Generator(session, tokenizer, 64, end_ids(tokenizer)), [1], GREEDY)
    assert generation.text() == "a + b"
    assert (generation.finish_reason, generation.completion_tokens) == ("stop", len(ids))


def test_prompt_limits_name_the_field(tokenizer):
    generator, _, _ = scripted(tokenizer, "x", block_size=8, max_prompt_tokens=100)
    assert generator.max_prompt_tokens == 7  # one position left to generate into
    with pytest.raises(PromptError, match=r"^prompt: \d+ tokens, more than the limit of 7$"):
        generator.encode("def add(a, b):\n    return a + b\n")
    with pytest.raises(PromptError, match="text_input: must not be empty"):
        generator.encode("", field_name="text_input")


def test_sampling_filters_and_is_reproducible():
    logits = np.log(np.asarray([0.5, 0.3, 0.15, 0.05]))

    def draw(params: SamplingParams, seed: int = 0) -> np.ndarray:
        rng = np.random.default_rng(seed)
        return np.bincount([sample(logits, params, rng) for _ in range(4000)], minlength=4)

    full = draw(SamplingParams(temperature=1.0)) / 4000
    np.testing.assert_allclose(full, [0.5, 0.3, 0.15, 0.05], atol=0.03)
    assert draw(SamplingParams(temperature=1.0, top_k=2))[2:].sum() == 0
    # top_p 0.7: 0.5 alone is short of it, 0.5 + 0.3 reaches it: the nucleus is {0, 1}.
    nucleus = draw(SamplingParams(temperature=1.0, top_p=0.7))
    assert nucleus[2:].sum() == 0 and nucleus[1] > 0
    assert draw(SamplingParams(temperature=0)).tolist() == [4000, 0, 0, 0]
    cold = draw(SamplingParams(temperature=0.2)) / 4000
    assert cold[0] > 0.9  # a low temperature sharpens towards the argmax
    np.testing.assert_array_equal(draw(SamplingParams(), seed=7), draw(SamplingParams(), seed=7))


def test_rows_sampled_together_are_each_what_it_draws_alone():
    """A step's rows share one sampling pass (plain softmax, greedy, top-k, top-p and mixed
    temperatures together); each row's token is the one it draws alone with its own seed, and
    the two-level draw follows the softmax over a vocabulary of several blocks (and a last,
    short one)."""
    vocab = 3 * DRAW_BLOCK + 5
    logits = np.random.default_rng(0).normal(0, 2, (6, vocab)).astype(np.float32)
    params = [
        SamplingParams(temperature=1.0),
        SamplingParams(temperature=0),
        SamplingParams(temperature=0.7, top_k=5),
        SamplingParams(temperature=1.3),
        SamplingParams(temperature=1.0, top_p=0.5),
        SamplingParams(temperature=1.0, top_k=vocab),  # no restriction: the shared pass
    ]
    together = [np.random.default_rng(i) for i in range(6)]
    alone = [np.random.default_rng(i) for i in range(6)]
    for _ in range(200):
        tokens = sample_rows(logits, params, together)
        assert tokens == [sample(logits[i], params[i], alone[i]) for i in range(6)]
    rng = np.random.default_rng(1)
    drawn = np.bincount(
        sample_rows(np.repeat(logits[:1], 20000, axis=0), [params[0]] * 20000, [rng] * 20000),
        minlength=vocab,
    )
    probs = np.exp(logits[0] - logits[0].max())
    probs /= probs.sum()
    np.testing.assert_allclose(drawn / 20000, probs, atol=0.01)
    assert drawn[probs < 1e-6].sum() == 0


def _nucleus_by_full_sort(probs: np.ndarray, top_p: float) -> np.ndarray:
    order = np.argsort(-probs, kind="stable")
    sorted_probs = probs[order]
    keep = np.cumsum(sorted_probs) - sorted_probs < top_p
    out = np.zeros_like(probs)
    out[order[keep]] = sorted_probs[keep]
    return out / out.sum()


@pytest.mark.parametrize("seed", range(6))
def test_partial_selection_keeps_what_a_full_sort_keeps_ties_included(seed):
    rng = np.random.default_rng(seed)
    vocab = 5000
    # Peaked, flat and tied distributions: quantised logits make many exact ties.
    logits = np.round(rng.normal(0, [0.5, 3, 8][seed % 3], vocab), 1)
    logits[rng.integers(0, vocab, 40)] = logits.max()  # a tie at the very top
    probs = np.exp(logits - logits.max())
    probs /= probs.sum()
    for top_p in (1e-6, 0.1, 0.5, 0.9, 0.999, 0.9999999):
        np.testing.assert_array_equal(nucleus(probs, top_p), _nucleus_by_full_sort(probs, top_p))
    for top in (0, 1, 5, 20, vocab):
        expected = np.argsort(-logits, kind="stable")[:top]
        np.testing.assert_array_equal(top_tokens(logits, top), expected)


# --- the exported graph of a real (tiny, random) GPT -----------------------------------------------


@pytest.fixture(scope="module")
def exported(tmp_path_factory, tokenizer):
    torch.manual_seed(0)
    model = GPT(tokenizer.get_vocab_size(), block_size=32, dim=32, layers=2, heads=4, ff_dim=64)
    work = tmp_path_factory.mktemp("lm")
    fp32, int8 = str(work / "model.onnx"), str(work / "model.int8.onnx")
    export_kv_onnx(model.eval(), fp32, opset=17)
    quantize_weight_only(fp32, int8)
    sessions = {
        v: art.create_session(Path(p).read_bytes()) for v, p in (("fp32", fp32), ("int8", int8))
    }
    return model, sessions


def test_streams_of_different_lengths_stepped_together_get_their_own_tokens(exported):
    """Three prompts (3, 5 and 8 tokens) prefilled alone, then decoded greedily in one batch
    (left-padded caches, masked), one joining late and one leaving early, give each stream the
    logits and tokens it gets decoded alone."""
    from app.runtime.kv import KVBatch

    _, sessions = exported
    decoder = KVDecoder(sessions["fp32"])
    rng = np.random.default_rng(1)
    prompts = [rng.integers(0, decoder.vocab_size, n).tolist() for n in (3, 5, 8)]
    alone = [greedy(decoder, p, 8) for p in prompts]

    batch, rows, out = KVBatch(decoder), {}, {i: [] for i in range(3)}
    pending: dict[int, int] = {}  # stream -> its next token

    def admit(i: int) -> None:
        logits, cache = decoder.step(np.asarray([prompts[i]]), decoder.empty_cache())
        rows[i] = batch.join(cache)
        pending[i] = int(logits[0, -1].argmax())

    admit(0)
    admit(2)
    for step in range(10):
        if step == 2:
            admit(1)  # joins a running batch
        for i, token in pending.items():
            out[i].append(token)
        done = [i for i in pending if len(out[i]) == (5 if i == 2 else 8)]  # 2 leaves early
        for i in done:
            gone = rows.pop(i)
            batch.leave(gone)
            rows = {j: r - (r > gone) for j, r in rows.items()}  # later rows move up one
            del pending[i]
        if not pending:
            break
        order = sorted(rows, key=rows.get)
        logits = batch.step([pending[i] for i in order])
        for i, row_logits in zip(order, logits, strict=True):
            pending[i] = int(row_logits.argmax())
    assert out[0] == alone[0] and out[1] == alone[1] and out[2] == alone[2][:5]


@torch.no_grad()
def test_onnx_graph_matches_torch_decode_for_prompt_and_cached_steps(exported):
    model, sessions = exported
    rows = np.random.default_rng(0).integers(0, model.tokens.num_embeddings, (3, 33))
    parity = decode_parity(model, KVDecoder(sessions["fp32"]), rows, steps=4)
    assert parity["max_abs_diff"] < 1e-4
    # Greedy continuation through the ONNX cache == argmax of torch's full forward each step.
    prompt = rows[0, :6].tolist()
    ids = list(prompt)
    for _ in range(8):
        ids.append(int(model(torch.tensor([ids]))[0, -1].argmax()))
    assert greedy(KVDecoder(sessions["fp32"]), prompt, 8) == ids[6:]


def test_int8_graph_scores_like_fp32_and_fp32_like_torch(exported):
    model, sessions = exported
    decoders = {v: KVDecoder(s) for v, s in sessions.items()}
    rows = np.random.default_rng(1).integers(0, model.tokens.num_embeddings, (4, 33))
    held = HeldOut.text(rows)
    fp32, int8 = perplexity(decoders["fp32"], held), perplexity(decoders["int8"], held)
    assert abs(int8 / fp32 - 1) < 0.05
    with torch.no_grad():
        logits = model(torch.from_numpy(rows[:, :-1]))
        expected = torch.nn.functional.cross_entropy(
            logits.flatten(0, 1), torch.from_numpy(rows[:, 1:]).flatten()
        )
    assert fp32 == pytest.approx(float(expected.exp()), rel=1e-4)
    # A chat row counts its trained targets only: here the second half of each row.
    half = HeldOut(rows, held.trained & (np.arange(33) >= 17))
    with torch.no_grad():
        second = torch.nn.functional.cross_entropy(
            logits[:, 16:].flatten(0, 1), torch.from_numpy(rows[:, 17:]).flatten()
        )
    assert perplexity(decoders["fp32"], half) == pytest.approx(float(second.exp()), rel=1e-4)
    agreement = greedy_agreement(decoders, [r[:4].tolist() for r in rows], 8)
    assert 0 <= agreement["prefix_agreement"] <= agreement["token_agreement"] <= 1


def test_seeded_sampling_of_the_exported_model_is_deterministic(exported, tokenizer):
    _, sessions = exported
    generator = Generator(sessions["int8"], tokenizer, 32, end_ids(tokenizer))
    prompt = generator.encode("def ")
    run = lambda seed: alone(  # noqa: E731
        generator, prompt, SamplingParams(max_tokens=12, temperature=1.0, top_k=50, seed=seed)
    )
    a, b = run(3), run(3)
    assert a[:3] == b[:3]
    assert len({run(seed)[0] for seed in range(4)}) > 1  # the seed does drive the draws


def test_a_prompt_too_long_for_the_limit_is_refused_before_it_is_tokenized(exported, tokenizer):
    """A 4 MiB prompt is refused by its length alone: the tokenizer is never called."""
    _, sessions = exported

    class Counting:
        def __init__(self, inner):
            self.inner, self.calls = inner, 0

        def encode(self, *args, **kwargs):
            self.calls += 1
            return self.inner.encode(*args, **kwargs)

        def __getattr__(self, name):
            return getattr(self.inner, name)

    counted = Counting(tokenizer)
    generator = Generator(sessions["int8"], counted, 32, end_ids(tokenizer), max_prompt_tokens=16)
    with pytest.raises(PromptError, match="characters, more than the 16-token limit"):
        generator.encode("x" * (4 << 20))
    assert counted.calls == 0
    # At the limit's edge the tokenizer decides, as before.
    assert generator.encode("def f(x): return x")
    assert counted.calls == 1


def test_penalties_lower_the_logits_of_generated_tokens_once_and_per_time():
    logits = np.array([1.0, 0.9, 0.2])
    assert SamplingParams().penalized(logits, {0: 3}) is logits  # none asked: untouched
    presence = SamplingParams(presence_penalty=0.5).penalized(logits, {0: 3})
    frequency = SamplingParams(frequency_penalty=0.1).penalized(logits, {0: 3, 2: 1})
    np.testing.assert_allclose(presence, [0.5, 0.9, 0.2])
    np.testing.assert_allclose(frequency, [0.7, 0.9, 0.1])
    np.testing.assert_allclose(
        SamplingParams(presence_penalty=-1).penalized(logits, {2: 1}), [1, 0.9, 1.2]
    )


def test_a_frequency_penalty_breaks_greedy_repetition(tokenizer):
    """A model that always predicts one token (logit 10, the rest 0) repeats it to max_tokens;
    with the penalties at their maximum the token loses its lead after four times."""
    generator, _, script = scripted(tokenizer, "x" * 64)
    repeated = Stepped(generator, [1], GREEDY).text()
    penalized = Stepped(
        generator,
        [1],
        SamplingParams(max_tokens=64, temperature=0, presence_penalty=2, frequency_penalty=2),
    ).text()
    assert repeated.count("x") > 40
    assert penalized.count("x") <= 4


def test_the_decode_loop_gives_each_concurrent_stream_its_own_answer(exported, tokenizer):
    """Streams submitted together (greedy, seeded sampling with penalties, one asking for more
    than the position table has left) share the loop's steps and each gets the text, finish
    reason and token count it gets alone."""
    from app.runtime.decode_loop import DecodeLoop

    _, sessions = exported
    generator = Generator(sessions["fp32"], tokenizer, 32, end_ids(tokenizer))
    rng = np.random.default_rng(2)
    prompts = [rng.integers(0, tokenizer.get_vocab_size(), n).tolist() for n in (2, 4, 6)]
    params = [
        SamplingParams(max_tokens=12, temperature=0),
        SamplingParams(max_tokens=20, temperature=1.0, seed=5, frequency_penalty=0.5),
        SamplingParams(max_tokens=40, temperature=0, logprobs=3),
    ]
    answers = [alone(generator, prompt, p) for prompt, p in zip(prompts, params, strict=True)]
    assert len(answers[2][3]) == answers[2][2]  # a logprob per token

    # The loop's first model call waits until all three are submitted: on a busy machine the
    # first stream could otherwise finish before the third one arrives.
    submitted = threading.Event()
    hooks.install("decode.call", lambda streams: submitted.wait(10))

    async def together():
        loop = DecodeLoop(generator)
        streams = [loop.submit(prompt, p) for prompt, p in zip(prompts, params, strict=True)]
        submitted.set()
        results = await asyncio.gather(*(read(s) for s in streams))
        loop.close()
        return results, loop.stats

    try:
        results, stats = asyncio.run(together())
    finally:
        hooks.clear()
    assert [r[:3] for r in results] == [a[:3] for a in answers]
    for together_, alone_ in zip(results, answers, strict=True):
        assert [t.token for t in together_[3]] == [t.token for t in alone_[3]]
        assert [t.logprob for t in together_[3]] == pytest.approx([t.logprob for t in alone_[3]])
    assert stats["batch_peak"] == 3  # the streams really shared steps


async def read(stream, stop_after: int | None = None):
    """A stream's text, finish reason, tokens and their logprobs; its client leaves after
    `stop_after` tokens."""
    text, logprobs = "", []
    async for piece in stream:
        text, logprobs = text + piece.text, logprobs + list(piece.logprobs)
        if stop_after is not None and stream.completion_tokens >= stop_after:
            stream.close()
    return text, stream.finish_reason, stream.completion_tokens, logprobs


class GatedSession:
    """An ORT session whose every run waits for a permit: the test decides when steps happen."""

    def __init__(self, session):
        self.session, self.permits = session, threading.Semaphore(0)
        self.called = threading.Event()  # a run has come to the gate

    def get_inputs(self):
        return self.session.get_inputs()

    def get_outputs(self):
        return self.session.get_outputs()

    def run(self, *args):
        self.called.set()
        self.permits.acquire()
        return self.session.run(*args)


class SlowSession(GatedSession):
    """An ORT session whose every run takes at least `seconds`."""

    def __init__(self, session, seconds: float):
        super().__init__(session)
        self.seconds = seconds

    def run(self, *args):
        time.sleep(self.seconds)
        return self.session.run(*args)


def test_a_stream_interval_sends_the_tokens_of_each_interval_as_one_event(tokenizer):
    """With `stream_interval_s`, the tokens a stream makes within the interval after an event
    go out as the next one: fewer events than tokens, the same text, each token's logprob
    reported once."""
    from app.runtime.decode_loop import DecodeLoop

    text = "def add(a, b):\n    return a + b\n"
    generator, session, script = scripted(tokenizer, text)
    generator.decoder.session = SlowSession(session, 0.01)  # a token every 10 ms at least
    params = SamplingParams(max_tokens=len(script), temperature=0, logprobs=0)

    async def events(interval_s: float):
        loop = DecodeLoop(generator, stream_interval_s=interval_s)
        stream = loop.submit([1], params)
        pieces = [piece async for piece in stream]
        loop.close()
        return pieces

    session.runs = 0
    paced = asyncio.run(events(0.2))
    assert "".join(p.text for p in paced) == text
    assert sum(len(p.logprobs) for p in paced) == len(script) >= 8
    assert len(paced) <= len(script) // 2, [p.text for p in paced]


def test_a_stream_whose_client_leaves_is_dropped_from_the_batch_at_the_next_step(
    exported, tokenizer
):
    from app.runtime.decode_loop import DecodeLoop

    _, sessions = exported
    gated = GatedSession(sessions["fp32"])
    generator = Generator(gated, tokenizer, 32, end_ids(tokenizer))
    greedy_long = SamplingParams(max_tokens=25, temperature=0)

    async def scenario():
        loop = DecodeLoop(generator)
        leaving, staying = loop.submit([5, 6], greedy_long), loop.submit([7], greedy_long)
        gated.permits.release(2)  # both prompts in one call, then one shared step: 2 tokens each
        while leaving.completion_tokens < 2:
            await asyncio.sleep(0.01)
        leaving.close()
        gated.permits.release(100)
        results = await asyncio.gather(read(leaving), read(staying))
        loop.close()
        return results, loop.stats

    (left, stayed), stats = asyncio.run(scenario())
    assert left[1] == "cancelled" and left[2] <= 3  # at most the step already under way
    gated.permits.release(100)
    assert stayed[:3] == alone(generator, [7], greedy_long)[:3]


class RecordingSession(GatedSession):
    """A gated session that also notes the shape of every call's input_ids."""

    def __init__(self, session):
        super().__init__(session)
        self.shapes: list[tuple[int, ...]] = []

    def run(self, outputs, feed):
        self.called.set()
        self.permits.acquire()
        self.shapes.append(feed["input_ids"].shape)
        return self.session.run(outputs, feed)


def test_a_long_prompt_fills_its_cache_in_chunks_between_the_running_streams_steps(
    exported, tokenizer
):
    """A 13-token prompt, 4 tokens a chunk, arrives while a stream runs: the running stream
    takes steps between its chunks, and the new stream's answer is the one it gets alone."""
    from app.runtime.decode_loop import DecodeLoop

    _, sessions = exported
    recording = RecordingSession(sessions["fp32"])
    generator = Generator(recording, tokenizer, 32, end_ids(tokenizer))
    long_prompt = np.random.default_rng(3).integers(0, tokenizer.get_vocab_size(), 13).tolist()
    running_params = SamplingParams(max_tokens=18, temperature=0)
    params = SamplingParams(max_tokens=6, temperature=0)

    async def scenario():
        loop = DecodeLoop(generator, prefill_chunk=4)
        running = loop.submit([5], running_params)
        recording.permits.release(2)  # its prompt and one step: it is in the batch
        while running.completion_tokens < 2:
            await asyncio.sleep(0.001)
        late = loop.submit(long_prompt, params)
        recording.permits.release(1000)
        results = await asyncio.gather(read(running), read(late))
        loop.close()
        return results

    (_, late) = asyncio.run(scenario())
    chunk_calls = [i for i, shape in enumerate(recording.shapes) if shape == (1, 4)]
    assert len(chunk_calls) == 3  # 4 + 4 + 4, then the last token alone
    between = recording.shapes[chunk_calls[0] : chunk_calls[-1]]
    assert (1, 1) in between  # the running stream stepped while the prompt went in
    recording.permits.release(1000)
    assert late[:3] == alone(generator, long_prompt, params)[:3]


class MeasuringSession:
    """An ORT session that notes the bytes of every call's cache inputs and outputs."""

    def __init__(self, session):
        self.session, self.peak = session, 0

    def get_inputs(self):
        return self.session.get_inputs()

    def get_outputs(self):
        return self.session.get_outputs()

    def run(self, outputs, feed):
        result = self.session.run(outputs, feed)
        past = sum(v.nbytes for k, v in feed.items() if k.startswith("past_"))
        present = sum(v.nbytes for v in result[1:])
        self.peak = max(self.peak, past + present)
        return result


def test_the_kv_budget_counts_the_padded_batch_and_a_steps_outputs(exported, tokenizer):
    """One long stream beside short ones (a 900-token prompt beside fifteen 7-token ones, in
    small): the batch left-pads every row to the longest and a step writes its outputs beside
    it, so only what those arrays fit in is admitted, the rest wait and are a 503, and the
    arrays measured in every call while the admitted streams run stay within the budget."""
    from app.runtime.decode_loop import DecodeLoop
    from app.runtime.types import RequestError
    from app.tasks.lm.replica import KVBudget

    _, sessions = exported
    measuring = MeasuringSession(sessions["fp32"])
    generator = Generator(measuring, tokenizer, 32, end_ids(tokenizer))
    limit = 60 * 1024  # bytes: 120 tokens of this model, 512 bytes each
    budget = KVBudget(limit / 2**20, generator.decoder, wait_s=0.05)
    assert budget.bytes_per_token == 512
    long_prompt, short_prompts = list(range(5, 25)), [[5 + i, 6] for i in range(15)]
    # Counted one stream at a time (prompt + max_tokens each), all sixteen would fit:
    assert (24 + 15 * 6) * budget.bytes_per_token <= limit
    no_end = SamplingParams(max_tokens=4, temperature=1.0, seed=1)

    async def scenario():
        admitted, refused = [long_prompt], []
        await budget.reserve(24, "m")
        for prompt in short_prompts:
            try:
                await budget.reserve(6, "m")
                admitted.append(prompt)
            except RequestError as e:
                refused.append(e)
        loop = DecodeLoop(generator)
        results = await asyncio.gather(*(read(loop.submit(p, no_end)) for p in admitted))
        loop.close()
        return results, refused

    results, refused = asyncio.run(scenario())
    assert len(results) == 2 and len(refused) == 14
    assert all(e.status == 503 and e.retry_after_s == 1 for e in refused)
    assert "serve.generation.max_kv_cache_mib" in refused[0].message
    assert measuring.peak > limit / 4  # the long stream's cache is really there
    assert measuring.peak <= limit


def test_a_stream_waits_for_kv_room_and_one_that_never_fits_is_a_400():
    from types import SimpleNamespace

    from app.runtime.types import RequestError
    from app.tasks.lm.replica import KVBudget

    decoder = SimpleNamespace(layers=2, heads=4, head_dim=8)  # 512 bytes a token
    budget = KVBudget(1.0, decoder, wait_s=5.0)  # 1 MiB: 1024 padded tokens with a step's outputs

    async def scenario():
        await budget.reserve(900, "m")
        waiting = asyncio.ensure_future(budget.reserve(7, "m"))  # 2 x 900 padded: no room yet
        await asyncio.sleep(0.1)
        assert not waiting.done()
        budget.release(900)
        await asyncio.wait_for(waiting, 1.0)  # admitted as soon as the long stream ended
        with pytest.raises(RequestError) as never:
            await budget.reserve(1500, "m")  # more than the whole budget: no wait helps
        assert never.value.status == 400
        await KVBudget(None, decoder).reserve(10**9, "m")  # unset: the stream count bounds it

    asyncio.run(scenario())
    assert budget.needs == [7]


def test_prompts_that_arrive_together_fill_their_caches_in_one_call(exported, tokenizer):
    """Three short prompts of different lengths submitted at once take one right-padded call,
    and each stream's greedy answer is the one it gets alone."""
    from app.runtime.decode_loop import DecodeLoop

    _, sessions = exported
    recording = RecordingSession(sessions["fp32"])
    generator = Generator(recording, tokenizer, 32, end_ids(tokenizer))
    prompts = [[5], [6, 7, 8], [9, 10, 11, 12, 13]]
    params = SamplingParams(max_tokens=8, temperature=0)

    async def scenario():
        loop = DecodeLoop(generator)
        first = loop.submit([4, 4], params)  # its prefill waits on the gate: the others queue
        while not recording.called.is_set():
            await asyncio.sleep(0.001)
        streams = [loop.submit(prompt, params) for prompt in prompts]
        recording.permits.release(1000)
        results = await asyncio.gather(read(first), *(read(s) for s in streams))
        loop.close()
        return results[1:]

    together = asyncio.run(scenario())
    assert recording.shapes[0] == (1, 2) and (3, 5) in recording.shapes  # one call for three
    recording.permits.release(1000)
    for prompt, result in zip(prompts, together, strict=True):
        assert result[:3] == alone(generator, prompt, params)[:3]


# --- a model call that fails ---------------------------------------------------------------------


@pytest.fixture
def faults():
    from tests import fault_hooks

    fault_hooks.install_hooks()
    yield fault_hooks
    hooks.clear()


async def outcome(stream):
    """(text, finish reason, tokens) of a stream, or the RequestError it ended with."""
    from app.runtime.types import RequestError

    text = ""
    try:
        async for piece in stream:
            text += piece.text
    except RequestError as e:
        return e
    return text, stream.finish_reason, stream.completion_tokens


def alone_answers(generator, prompts, params):
    return [alone(generator, p, s)[:3] for p, s in zip(prompts, params, strict=True)]


def test_a_failed_step_ends_the_stream_it_belongs_to_and_the_others_go_on(
    exported, tokenizer, faults
):
    """Three streams stepped together; one's model calls start failing after its second token
    (an ONNX Runtime failure mid-stream). The batched step fails, each row steps alone once:
    the faulty stream ends with a 500 after the text it had, the others end as they do alone
    (never a truncated answer), and the loop serves the next stream."""
    from app.runtime.decode_loop import DecodeLoop
    from app.runtime.types import RequestError

    _, sessions = exported
    generator = Generator(sessions["fp32"], tokenizer, 32, end_ids(tokenizer))
    prompts = [[5, 6], [7], [8, 9, 10]]
    params = [
        SamplingParams(max_tokens=20, temperature=0),
        SamplingParams(max_tokens=20, temperature=0, seed=faults.FAIL_SEED),
        SamplingParams(max_tokens=25, temperature=1.0, seed=3),
    ]

    async def scenario():
        loop = DecodeLoop(generator, model="tiny")
        streams = [loop.submit(p, s) for p, s in zip(prompts, params, strict=True)]
        results = await asyncio.gather(*(outcome(s) for s in streams))
        after = await outcome(loop.submit([11], params[0]))
        loop.close()
        return results, after, loop.stats

    (first, failed, third), after, stats = asyncio.run(scenario())
    expected = alone_answers(generator, prompts[::2], params[::2])
    assert [first, third] == expected
    assert isinstance(failed, RequestError) and failed.status == 500
    assert "tiny" in failed.message and "InjectedFault" in failed.message
    assert after == alone_answers(generator, [[11]], params[:1])[0]
    assert stats["failed"] == 1


def test_a_prompt_whose_fill_fails_ends_alone_and_a_join_without_memory_is_a_503(
    exported, tokenizer, faults
):
    """Prompts filled together, one of whose calls always fails: each is filled alone, and only
    that one ends (500). A stream whose join finds no memory ends with a 503 to retry; the
    running stream beside it is untouched."""
    from app.runtime.decode_loop import DecodeLoop
    from app.runtime.types import RequestError

    _, sessions = exported
    generator = Generator(sessions["fp32"], tokenizer, 32, end_ids(tokenizer))
    greedy_ = SamplingParams(max_tokens=12, temperature=0)
    bad_fill = SamplingParams(max_tokens=12, temperature=0, seed=faults.FAIL_AT_ONCE_SEED)
    no_memory = SamplingParams(max_tokens=12, temperature=0, seed=faults.MEMORY_SEED)

    async def scenario():
        loop = DecodeLoop(generator, model="tiny")
        streams = [loop.submit([5], greedy_), loop.submit([6], bad_fill)]
        streams.append(loop.submit([7, 8], no_memory))
        streams.append(loop.submit([9], greedy_))
        results = await asyncio.gather(*(outcome(s) for s in streams))
        loop.close()
        return results

    ok, failed, refused, ok2 = asyncio.run(scenario())
    assert [ok, ok2] == alone_answers(generator, [[5], [9]], [greedy_, greedy_])
    assert isinstance(failed, RequestError) and failed.status == 500
    assert isinstance(refused, RequestError) and refused.status == 503
    assert refused.retry_after_s == 1 and "memory" in refused.message


def test_ended_generations_are_counted_by_reason():
    from app.serve.metrics import MetricBuffer
    from app.tasks.lm.replica import _GenerationMetrics, _Timing

    buffer = MetricBuffer(interval_s=3600)  # no flush during the test
    metrics = _GenerationMetrics("counted-lm", buffer)
    for reason in ("stop", "length", "cancelled", "cancelled", "error"):
        metrics.observe(_Timing(), 0, reason)
    counts = {
        dict(tags).get("reason"): n
        for (counter, tags), n in buffer._counts.items()
        if counter is metrics.ended
    }
    assert counts == {"stop": 1, "length": 1, "cancelled": 2, "error": 1}
