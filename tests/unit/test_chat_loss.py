"""The loss a chat fine-tune trains: packed rows keep their conversations apart (a neighbour's
change moves neither logits nor loss, and a packed batch's loss is its conversations' alone),
and the cross entropy computed in chunks inside the model has the unchunked loss's value and
gradients; for GPT and the Llama-style decoder alike."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from app.data.packing import Tokenized, packed
from app.models import causal
from app.models.causal import IGNORE
from app.models.gpt import GPT
from app.models.llama import DecoderArgs, LlamaLM
from app.tasks.lm.train import SEGMENTS_KEY, TOKENS_KEY, TRAINED_KEY, logits_loss, scored

pytestmark = pytest.mark.unit

VOCAB, WIDTH = 97, 33


def llama() -> LlamaLM:
    args = DecoderArgs(
        vocab_size=VOCAB, dim=32, layers=2, heads=4, kv_heads=2, head_dim=8, ff_dim=64,
        max_positions=64, tied=True,
    )  # fmt: skip
    return LlamaLM(args)


def gpt() -> GPT:
    return GPT(VOCAB, block_size=64, dim=32, layers=2, heads=4)


MODELS = {"llama": llama, "gpt": gpt}


def conversation(seed: int, length: int) -> Tokenized:
    rng = np.random.default_rng(seed)
    trained = np.zeros(length, dtype=np.uint8)
    trained[length // 2 :] = 1  # the answer: the second half
    return Tokenized(rng.integers(1, VOCAB, length).astype(np.int32), trained)


def batch_of(rows) -> dict[str, torch.Tensor]:
    return {
        TOKENS_KEY: torch.from_numpy(rows.ids.astype(np.int64)),
        TRAINED_KEY: torch.from_numpy(rows.trained),
        SEGMENTS_KEY: torch.from_numpy(rows.segments),
    }


@pytest.fixture(params=sorted(MODELS))
def model(request) -> torch.nn.Module:
    torch.manual_seed(0)
    return MODELS[request.param]().eval()


def test_a_changed_conversation_moves_neither_its_neighbours_logits_nor_their_loss(model):
    # Longest first, as packing places them: segments 1, 2 and 3 in this order.
    sequences = [conversation(1, 11), conversation(2, 9), conversation(3, 8)]
    changed = [sequences[0], conversation(99, 9), sequences[2]]
    rows = [packed(s, WIDTH, 0) for s in (sequences, changed)]
    assert len(rows[0]) == 1 and rows[0].segments.max() == 3  # all three in one row
    assert rows[0].ids[0, 11:20].tolist() == sequences[1].ids.tolist()  # segment 2 is the second
    logits, losses = [], []
    for r in rows:
        batch = batch_of(r)
        from app.tasks.lm.train import model_inputs

        inputs, _ = model_inputs(batch, torch.device("cpu"), trim=False)
        with torch.no_grad():
            logits.append(model(**inputs))
            losses.append(per_conversation_losses(model, r))
    neighbours = torch.from_numpy(rows[0].segments[0, :-1] != 2)
    torch.testing.assert_close(logits[0][0, neighbours], logits[1][0, neighbours])
    assert losses[0][1] == pytest.approx(losses[1][1], rel=1e-6)  # the first conversation's
    assert losses[0][3] == pytest.approx(losses[1][3], rel=1e-6)  # the third's
    assert losses[0][2] != pytest.approx(losses[1][2], rel=1e-3)  # the changed one's moved


def per_conversation_losses(model: torch.nn.Module, rows) -> dict[int, float]:
    from app.tasks.lm.train import model_inputs

    inputs, targets = model_inputs(batch_of(rows), torch.device("cpu"), trim=False)
    logits = model(**inputs)
    out = {}
    for number in (1, 2, 3):
        mine = torch.from_numpy(rows.segments[:, 1:] == number)
        only = torch.where(mine, targets, torch.full_like(targets, IGNORE))
        out[number] = float(logits_loss(logits, only).total)
    return out


def test_a_packed_batch_scores_as_its_conversations_one_a_row(model):
    sequences = [conversation(seed, length) for seed, length in enumerate([7, 12, 9, 5, 10, 8])]
    with torch.no_grad():
        together = scored(model, batch_of(packed(sequences, WIDTH, 0)), torch.device("cpu"))
        apart = scored(
            model, batch_of(packed(sequences, WIDTH, 0, pack=False)), torch.device("cpu")
        )
    assert (
        int(together.tokens)
        == int(apart.tokens)
        == sum(int(s.trained[1:].sum()) for s in sequences)
    )
    assert float(together.total) == pytest.approx(float(apart.total), rel=1e-5)
    assert int(together.correct) == int(apart.correct)


@pytest.mark.parametrize("pack", [True, False], ids=["packed", "one-a-row"])
def test_a_batch_cut_after_its_longest_row_has_the_same_loss_and_gradients(model, pack):
    from app.tasks.lm.train import model_inputs

    sequences = [conversation(seed, length) for seed, length in enumerate([7, 12, 9, 5])]
    batch = batch_of(packed(sequences, WIDTH, 0, pack=pack))
    used = int((batch[SEGMENTS_KEY] > 0).sum(1).max())
    results = []
    for trim in (True, False):
        model.zero_grad()
        inputs, targets = model_inputs(batch, torch.device("cpu"), trim=trim)
        out = logits_loss(model(**inputs), targets)
        out.mean.backward()
        grads = [p.grad.clone() for p in model.parameters()]
        results.append((inputs["input_ids"].shape[1], out, grads, "attention_mask" in inputs))
    (cut, short, short_grads, masked), (whole, full, full_grads, _) = results
    assert (cut, whole) == (used - 1, WIDTH - 1)  # the padding every row ends in is gone
    assert masked == pack  # one sequence a row needs no mask: causal attention suffices
    assert int(short.tokens) == int(full.tokens) > 0
    assert short.total.item() == pytest.approx(full.total.item(), rel=1e-5)
    for a, b in zip(short_grads, full_grads, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)


def test_the_chunked_loss_has_the_whole_losss_value_and_gradients(model, monkeypatch):
    sequences = [conversation(seed, 30) for seed in range(4)]
    batch = batch_of(packed(sequences, WIDTH, 0, pack=False))
    model.train()

    def gradients() -> tuple[float, list[torch.Tensor]]:
        model.zero_grad()
        loss = scored(model, batch, torch.device("cpu")).mean
        loss.backward()
        return loss.item(), [p.grad.clone() for p in model.parameters()]

    whole_loss, whole = gradients()  # one chunk: the whole vocabulary x every trained token
    monkeypatch.setattr(causal, "LOSS_CHUNK_ELEMENTS", VOCAB * 5)  # 5 tokens a chunk
    chunked_loss, chunked = gradients()
    assert chunked_loss == pytest.approx(whole_loss, rel=1e-6)
    for a, b in zip(whole, chunked, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)
    # ... and both are the plain cross entropy of the model's logits
    from app.tasks.lm.train import model_inputs

    inputs, targets = model_inputs(batch, torch.device("cpu"))
    plain = logits_loss(model(**inputs), targets).mean
    assert plain.item() == pytest.approx(whole_loss, rel=1e-6)


def test_a_batch_without_a_trained_token_has_zero_loss_and_every_gradient(model):
    batch = batch_of(
        packed([Tokenized(np.arange(1, 9, dtype=np.int32), np.zeros(8, np.uint8))], WIDTH, 0)
    )
    model.train()
    out = scored(model, batch, torch.device("cpu"))
    out.mean.backward()
    assert out.mean.item() == 0.0 and int(out.tokens) == 0
    assert all(p.grad is not None for p in model.parameters())
