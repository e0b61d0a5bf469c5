"""eval/pass@k: the unbiased estimator of Chen et al. 2021, per evaluation row, on that row's own
samples, checked against a direct count over every k-subset of the row's samples."""

from __future__ import annotations

import itertools
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from alignzoo.batch import RolloutBatch
from alignzoo.engine.evaluate import evaluate
from alignzoo.engine.hooks import Hooks
from alignzoo.types import SamplingParams, Score


def direct_pass_at_k(hits: list[bool], k: int) -> float:
    """The share of the k-subsets of a row's samples that hold a correct one (what pass@k
    estimates, counted without any formula)."""
    subsets = list(itertools.combinations(hits, k))
    return sum(any(s) for s in subsets) / len(subsets)


def patterned_hooks(calls: list[int]) -> Hooks:
    """A backend whose j-th sample of a row is right when the row's ``pattern[j]`` is 1 (and
    greedy answers right when ``pattern[0]`` is), and a labeler that marks right answers."""

    def generate(prompts, extras, n, sampling, seeds=None):
        calls.append(n)
        responses = [
            e["answer"] if e["pattern"][j % len(e["pattern"])] == "1" else "wrong"
            for e in extras
            for j in range(n)
        ]
        b = len(prompts) * n
        return RolloutBatch(
            prompt_ids=torch.ones(b, 1, dtype=torch.long),
            prompt_mask=torch.ones(b, 1, dtype=torch.long),
            response_ids=torch.ones(b, 1, dtype=torch.long),
            response_mask=torch.ones(b, 1),
            group_ids=torch.arange(len(prompts)).repeat_interleave(n),
            prompts=[p for p in prompts for _ in range(n)],
            responses=responses,
            extras=[dict(e) for e in extras for _ in range(n)],
        )

    def score_batch(requests):
        right = [r.response == r.extra["answer"] for r in requests]
        return [Score(float(c), info={"correct": c}) for c in right]

    return Hooks(SimpleNamespace(hook=SimpleNamespace(generate=generate, score_batch=score_batch)))


def rows_of(patterns: list[str], prompts: list[str]) -> list[dict[str, Any]]:
    return [
        {"prompt": p, "answer": "7", "pattern": pattern}
        for p, pattern in zip(prompts, patterns, strict=True)
    ]


def expected(patterns: list[str], n: int, k: int) -> float:
    """pass@k averaged over rows, each row scored on its own n samples."""
    per_row = [direct_pass_at_k([pattern[j % len(pattern)] == "1" for j in range(n)], k)
               for pattern in patterns]  # fmt: skip
    return sum(per_row) / len(per_row)


def test_repeated_prompts_count_once_per_row_with_their_own_samples() -> None:
    # 16 prompts, each twice; the two rows of a prompt are sampled separately, and a prompt's
    # first row may pass where its second does not. Merged by prompt text, the 2k samples of
    # a prompt would pass together, over a denominator of 16 prompts instead of 32 rows.
    k = 4
    prompts = [f"q{i}" for i in range(16)] * 2
    patterns = ["1000" if i % 8 < 3 else "0000" for i in range(16)]
    patterns += ["0000" if i % 8 < 3 else ("0100" if i % 2 else "0000") for i in range(16)]
    calls: list[int] = []
    out = evaluate(patterned_hooks(calls), rows_of(patterns, prompts), 3, pass_at_k=k)
    assert calls == [1, k]  # greedy, then k samples per row (n = k by default)
    assert out["eval/pass@4"] == pytest.approx(expected(patterns, k, k), abs=1e-12)
    # exact match counts every row too: the two agree on what "a row" is
    greedy = [p[0] == "1" for p in patterns]
    assert out["eval/exact_match"] == pytest.approx(sum(greedy) / len(greedy))


def test_more_samples_than_k_use_the_unbiased_estimator() -> None:
    k, n = 3, 8
    patterns = ["10000000", "11000000", "01010101", "00000000", "11111110", "00000001"]
    prompts = ["a", "b", "c", "d", "a", "b"]  # repeated prompts again, with n > k
    calls: list[int] = []
    out = evaluate(
        patterned_hooks(calls),
        rows_of(patterns, prompts),
        3,
        pass_at_k=k,
        sampling=SamplingParams(temperature=0.7),
        pass_at_k_samples=n,
    )
    assert calls == [1, n]
    want = expected(patterns, n, k)
    assert out["eval/pass@3"] == pytest.approx(want, abs=1e-12)
    # not the share of rows with any correct sample among all n (what pass@n would be)
    assert want != pytest.approx(expected(patterns, n, n))


def test_the_estimator_matches_the_direct_count_for_every_count() -> None:
    from alignzoo.engine.evaluate import pass_at_k_estimate

    for n in range(1, 9):
        for k in range(1, n + 1):
            for c in range(n + 1):
                hits = [True] * c + [False] * (n - c)
                assert pass_at_k_estimate(n, c, k) == pytest.approx(
                    direct_pass_at_k(hits, k), abs=1e-12
                )
