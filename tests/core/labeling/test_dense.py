"""Dense rewards: step scores (character spans of the response) placed on the response's tokens.

The oracle for the byte-level tokenizers is independent of decoding: a byte-level BPE token's
bytes are its symbols read back through GPT-2's byte-to-unicode table, so the token holding the
last byte of a span's last character is known exactly.
"""

from __future__ import annotations

import json
import math
import sqlite3

import pytest
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from alignzoo import Labeler
from alignzoo.batch import RolloutBatch
from alignzoo.config.schema import LabelingConfig, NormalizeConfig
from alignzoo.engine.hooks import Hooks
from alignzoo.labeling.dense import UNPLACED, dense_metrics, fill, place, response_offset
from alignzoo.labeling.interface import check_scores
from alignzoo.labeling.orchestrator import LabelingStage, label
from alignzoo.labeling.protocol import score_from_json, score_to_json
from alignzoo.labeling.store import LabelStore
from alignzoo.metrics import REWARD_DENSE_MEAN, REWARD_DENSE_STEPS, REWARD_DENSE_UNPLACED
from alignzoo.registry import build_plugin_manager
from alignzoo.types import LabelRequest, Outcome, Score, StepScore
from alignzoo.world.tokenizer import build_tokenizer

CORPUS = [
    "Schritt eins: wir addieren zwölf und sieben.\nSchritt zwei: das ergibt neunzehn.\n",
    "café crème, naïve façade, 日本語のテキスト, emoji 🙂 and more text\n",
    "Step 1: 12 + 7 = 19\nStep 2: so the answer is 19\n",
] * 20
TEXT = "Step 1: wir zählen 12 + 7 🙂\nStep 2: 日本語 = 19\nDone é"


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable symbol table (what ByteLevel pre-tokenizers write)."""
    bs = list(range(ord("!"), ord("~") + 1))
    bs += list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, (chr(c) for c in cs), strict=True))


SYMBOL_TO_BYTE = {s: b for b, s in bytes_to_unicode().items()}


@pytest.fixture(scope="module")
def bpe() -> PreTrainedTokenizerFast:
    """A byte-level BPE with merges, trained here on text with multi-byte characters."""
    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=["<|endoftext|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    backend.train_from_iterator(CORPUS, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="<|endoftext|>")


def oracle(tokenizer, ids: list[int], text: str, end: int) -> int:
    """The index of the token holding the last byte of ``text[:end]`` (byte-level tokens)."""
    last_byte = len(text[:end].encode("utf-8")) - 1
    at = 0
    for k, symbol in enumerate(tokenizer.convert_ids_to_tokens(ids)):
        at += len(symbol)  # one symbol per byte
        if at > last_byte:
            return k
    raise AssertionError("span past the tokens")


def all_spans(text: str) -> list[StepScore]:
    return [StepScore(0, end, 1.0) for end in range(1, len(text) + 1)]


def test_the_bpe_splits_multibyte_characters_and_merges_others(bpe) -> None:
    ids = bpe.encode(TEXT, add_special_tokens=False)
    symbols = bpe.convert_ids_to_tokens(ids)
    assert any(len(s) > 1 for s in symbols), "premise: merges happen"
    # premise: some token boundary falls inside a multi-byte character
    ends = [sum(len(s) for s in symbols[: k + 1]) for k in range(len(symbols))]
    char_ends = {len(TEXT[:i].encode()) for i in range(len(TEXT) + 1)}
    assert any(e not in char_ends for e in ends), "premise: a character split over tokens"
    assert bpe.decode(ids) == TEXT


@pytest.mark.parametrize("which", ["bpe", "embedded"])
def test_every_span_end_maps_to_the_token_holding_its_last_byte(which, bpe) -> None:
    tokenizer = bpe if which == "bpe" else build_tokenizer()
    ids = tokenizer.encode(TEXT, add_special_tokens=False)
    steps = all_spans(TEXT)
    placed = place(tokenizer, ids, TEXT, steps)
    expected = [oracle(tokenizer, ids, TEXT, step.end) for step in steps]
    assert placed == expected


def test_a_multibyte_character_belongs_to_the_token_of_its_last_byte() -> None:
    tokenizer = build_tokenizer()  # one token per byte
    text = "ab é\nc"
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert len(ids) == len(text.encode())  # é is two tokens
    # "ab é" ends with é: its second byte is token 4 (a, b, space, é1, é2)
    assert place(tokenizer, ids, text, [StepScore(0, 4, 1.0)]) == [4]
    assert place(tokenizer, ids, text, [StepScore(0, 5, 1.0), StepScore(5, 6, 0.5)]) == [5, 6]


def test_the_eos_token_is_trained_but_never_carries_a_step(bpe) -> None:
    ids = [*bpe.encode("one\ntwo", add_special_tokens=False), bpe.eos_token_id]
    placed = place(bpe, ids, "one\ntwo", [StepScore(0, 4, 1.0), StepScore(4, 7, 1.0)])
    assert placed[-1] == len(ids) - 2  # the last text token, not the EOS after it


def test_the_response_is_found_where_it_last_occurs_and_otherwise_nothing_is_placed() -> None:
    assert response_offset("abc", "abc") == 0
    assert response_offset("turn one\nabc", "abc") == 9
    assert response_offset("abc then abc!", "abc") == 9
    assert response_offset("something else", "abc") is None
    tokenizer = build_tokenizer()
    ids = tokenizer.encode("rewritten", add_special_tokens=False)
    assert place(tokenizer, ids, "original", [StepScore(0, 3, 1.0)]) == [None]


def batch_of(tokenizer, responses: list[str], env: dict[int, tuple[str, str]] | None = None):
    """A right-padded batch of ``responses``; for rows in ``env`` the row is
    ``first turn + environment text + the response``, the environment's tokens untrained."""
    rows, masks = [], []
    for i, text in enumerate(responses):
        if env and i in env:
            turn, between = env[i]
            a = tokenizer.encode(turn, add_special_tokens=False)
            b = tokenizer.encode(between, add_special_tokens=False)
            c = tokenizer.encode(text, add_special_tokens=False)
            rows.append(a + b + c + [tokenizer.eos_token_id])
            masks.append([1] * len(a) + [0] * len(b) + [1] * (len(c) + 1))
        else:
            ids = [*tokenizer.encode(text, add_special_tokens=False), tokenizer.eos_token_id]
            rows.append(ids)
            masks.append([1] * len(ids))
    width = max(len(r) for r in rows)
    ids = torch.tensor([r + [0] * (width - len(r)) for r in rows])
    mask = torch.tensor([m + [0] * (width - len(m)) for m in masks], dtype=torch.float32)
    return RolloutBatch(
        prompt_ids=torch.zeros((len(rows), 1), dtype=torch.long),
        prompt_mask=torch.ones((len(rows), 1), dtype=torch.long),
        response_ids=ids,
        response_mask=mask,
        group_ids=torch.arange(len(rows)),
        prompts=["p"] * len(rows),
        responses=list(responses),
        label_info=[{} for _ in rows],
    )


def test_fill_puts_each_step_on_its_last_token_and_leaves_stepless_samples_all_zero() -> None:
    tokenizer = build_tokenizer()
    batch = batch_of(tokenizer, ["ab\ncd", "xyz", "é\nf"])
    scores = [
        Score(1.0, steps=[StepScore(0, 3, 0.25), StepScore(3, 5, -0.5)]),
        Score(0.0),  # no steps
        Score(1.0, steps=[StepScore(0, 2, 2.0), StepScore(1, 2, 1.0), StepScore(2, 3, 3.0)]),
    ]
    fill(batch, scores, tokenizer)
    assert batch.dense_rewards is not None and batch.dense_mask is not None
    expected = torch.zeros_like(batch.response_mask)
    expected[0, 2], expected[0, 4] = 0.25, -0.5  # "ab\n" ends on token 2, "cd" on token 4
    # "é\n" (é is tokens 0-1) and "\n" both end on the newline, token 2: they add up, 2 + 1
    expected[2, 2] = 3.0
    expected[2, 3] = 3.0  # "f"
    torch.testing.assert_close(batch.dense_rewards, expected)
    torch.testing.assert_close(batch.dense_mask, (expected != 0).float())
    assert batch.dense_mask[1].sum() == 0
    m = dense_metrics(batch)
    assert m[REWARD_DENSE_STEPS] == pytest.approx(4 / 3)
    assert m[REWARD_DENSE_MEAN] == pytest.approx((0.25 - 0.5 + 3 + 3) / 4)
    assert m[REWARD_DENSE_UNPLACED] == 0.0


def test_fill_places_steps_on_trained_tokens_only_and_counts_what_it_cannot_place() -> None:
    tokenizer = build_tokenizer()
    batch = batch_of(
        tokenizer,
        ["ok\nyes", "lost"],
        env={0: ("call(1+1)", "\n<tool>2</tool>\n"), 1: ("a", "b")},
    )
    batch.responses[1] = "a text the policy never wrote"
    scores = [
        Score(1.0, steps=[StepScore(0, 3, 1.0), StepScore(3, 6, 2.0)]),
        Score(1.0, steps=[StepScore(0, 4, 1.0)]),
    ]
    fill(batch, scores, tokenizer)
    assert batch.dense_mask is not None and batch.dense_rewards is not None
    untrained = batch.response_mask == 0
    assert batch.dense_mask[untrained].sum() == 0  # never on the environment's tokens
    first, between = len("call(1+1)"), len("\n<tool>2</tool>\n")
    at = first + between  # where the response's tokens begin
    assert batch.dense_mask[0].nonzero().flatten().tolist() == [at + 2, at + 5]
    assert batch.dense_rewards[0, at + 5] == 2.0
    assert batch.dense_mask[1].sum() == 0 and batch.label_info[1][UNPLACED] == 1
    assert dense_metrics(batch)[REWARD_DENSE_UNPLACED] == 0.5


def test_no_steps_means_no_columns_and_no_metrics() -> None:
    tokenizer = build_tokenizer()
    batch = batch_of(tokenizer, ["ab", "cd"])
    fill(batch, [Score(1.0), Score.abstain("no")], tokenizer)
    assert batch.dense_rewards is None and batch.dense_mask is None
    assert dense_metrics(batch) == {}


def test_the_columns_survive_select_concat_and_to() -> None:
    tokenizer = build_tokenizer()
    dense = batch_of(tokenizer, ["ab\ncd", "x"])
    fill(dense, [Score(1.0, steps=[StepScore(0, 3, 0.5)]), Score(0.0)], tokenizer)
    plain = batch_of(tokenizer, ["a much longer response"])  # no step scores: None
    assert dense.dense_rewards is not None and dense.dense_mask is not None
    picked = dense.select([1, 0])
    assert picked.dense_rewards is not None and picked.dense_mask is not None
    torch.testing.assert_close(picked.dense_rewards[1], dense.dense_rewards[0])
    assert picked.dense_mask[0].sum() == 0
    both = RolloutBatch.concat([plain, dense])
    assert both.dense_rewards is not None and both.dense_mask is not None
    assert both.dense_rewards.shape == both.response_mask.shape == (3, plain.response_ids.shape[1])
    assert both.dense_mask[0].sum() == 0  # the part without steps: all zero
    torch.testing.assert_close(both.dense_rewards[1, :6], dense.dense_rewards[0])
    assert both.dense_rewards[1, 2] == 0.5
    moved = both.to("cpu")
    assert moved.dense_mask is not None and torch.equal(moved.dense_mask, both.dense_mask)
    assert RolloutBatch.concat([plain, plain]).dense_rewards is None


@pytest.mark.parametrize(
    ("steps", "says"),
    [
        ([StepScore(0, 9, 1.0)], "past the response's 5 characters"),
        ([StepScore(3, 3, 1.0)], "expected integers 0 <= start < end"),
        ([StepScore(-1, 2, 1.0)], "expected integers 0 <= start < end"),
        ([StepScore(0, 2, math.nan)], "non-finite"),
        ([(0, 2, 1.0)], "not a StepScore"),
    ],
)
def test_unusable_steps_are_rejected(steps, says) -> None:
    checked = check_scores([Score(1.0, steps=steps), Score(1.0)], 2, ["hello", "world"])
    assert not isinstance(checked, str)
    assert checked[0].outcome == Outcome.REJECTED and says in checked[0].info["reason"]
    assert checked[1].outcome == Outcome.VALUE


def test_steps_travel_over_the_wire_and_through_the_store(tmp_path) -> None:
    score = Score(0.5, info={"a": 1}, steps=[StepScore(0, 2, 0.25), StepScore(2, 5, 0.75)])
    back = score_from_json(json.loads(json.dumps(score_to_json(score))))
    assert back == score
    assert "steps" not in score_to_json(Score(1.0))
    store = LabelStore(tmp_path / "labels.sqlite")
    request = LabelRequest("p", "hello")
    store.put("prm", [("k1", request, score), ("k2", request, Score(1.0))], 0.1)
    found = store.lookup("prm", ["k1", "k2"])
    assert found["k1"] == score and found["k2"].steps == []
    store.close()


def test_a_store_written_before_step_scores_opens_and_keeps_its_labels(tmp_path) -> None:
    path = tmp_path / "old.sqlite"
    db = sqlite3.connect(path)
    db.execute(
        "CREATE TABLE labels (labeler TEXT NOT NULL, key TEXT NOT NULL, prompt TEXT NOT NULL, "
        "response TEXT NOT NULL, extra TEXT NOT NULL, outcome TEXT NOT NULL, value REAL, "
        "valid INTEGER NOT NULL, info TEXT NOT NULL, seconds REAL NOT NULL, "
        "created REAL NOT NULL, PRIMARY KEY (labeler, key))"
    )
    db.execute("INSERT INTO labels VALUES ('rm','k','p','r','{}','value',0.5,1,'{}',0.1,1.0)")
    db.commit()
    db.close()
    store = LabelStore(path)
    assert store.lookup("rm", ["k"])["k"] == Score(0.5, True, {}, Outcome.VALUE)
    store.put("rm", [("k2", LabelRequest("p", "ab"), Score(1.0, steps=[StepScore(0, 1, 2.0)]))], 0)
    assert store.lookup("rm", ["k2"])["k2"].steps == [StepScore(0, 1, 2.0)]
    store.close()


class Stepper(Labeler):
    """Scores ``len(response)`` with a step per line, each scored by its line's length."""

    def score(self, request: LabelRequest) -> Score:
        steps, at = [], 0
        for line in request.response.split("\n"):
            end = min(at + len(line) + 1, len(request.response))
            if end > at:
                steps.append(StepScore(at, end, float(len(line))))
            at = end
        return Score(float(len(request.response)), steps=steps)


def test_a_normalised_training_pass_rescales_the_value_and_places_the_steps_as_given() -> None:
    labeler = Stepper()
    cfg = LabelingConfig(normalize=NormalizeConfig(mode="fixed", scale=0.5), store=None)
    stage = LabelingStage.build(cfg, [("l0", labeler, Hooks(build_plugin_manager([labeler])))])
    tokenizer = build_tokenizer()
    batch = batch_of(tokenizer, ["abc\nde", "x"])
    report = label(Hooks(build_plugin_manager([labeler])), batch, stage, tokenizer=tokenizer)
    assert report.scores[0].steps == [StepScore(0, 4, 3.0), StepScore(4, 6, 2.0)]
    assert batch.scores is not None and batch.scores.tolist() != [6.0, 1.0]  # rescaled
    assert batch.dense_rewards is not None
    assert batch.dense_rewards[0, 3] == 3.0 and batch.dense_rewards[0, 5] == 2.0  # as given
    assert batch.dense_rewards[1, 0] == 1.0
    evaluation = batch_of(tokenizer, ["abc\nde"])
    label(Hooks(build_plugin_manager([labeler])), evaluation, stage, normalize=False)
    assert evaluation.dense_rewards is None  # no tokenizer: nothing placed


def test_bytes_that_never_form_a_character_count_where_they_are() -> None:
    tokenizer = build_tokenizer()  # one token per byte: a lone continuation byte is possible
    lone = tokenizer.convert_tokens_to_ids(bytes_to_unicode()[0x80])
    for ids in (
        [*tokenizer.encode("12", add_special_tokens=False), lone],  # at the end
        [
            *tokenizer.encode("1", add_special_tokens=False),
            lone,
            *tokenizer.encode("2", add_special_tokens=False),
        ],
    ):
        text = tokenizer.decode(ids, skip_special_tokens=True)
        assert "\ufffd" in text and len(text) == 3  # what the backend hands the labeler
        steps = all_spans(text)
        assert place(tokenizer, ids, text, steps) == [0, 1, 2]
