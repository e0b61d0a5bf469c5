"""Offline rows to tensors (alignzoo.engine.tokenize)."""

from __future__ import annotations

from alignzoo.engine.tokenize import tokenized_batch


def test_offline_prompts_are_encoded_like_the_backend_encodes_them() -> None:
    calls: list[tuple[str, bool]] = []

    class Tok:
        eos_token_id, pad_token_id = 1, 0

        def __call__(self, texts, add_special_tokens=True):  # batched, as the engine calls it
            assert isinstance(texts, list)
            calls.extend((text, add_special_tokens) for text in texts)
            bos = [7] if add_special_tokens else []
            return {"input_ids": [bos + [ord(c) for c in text] for text in texts]}

    batch = tokenized_batch(Tok(), ["ab"], ["c"], [{}], max_new_tokens=8)
    assert ("ab", True) in calls and ("c", False) in calls  # BOS on prompts, not on responses
    assert batch.prompt_ids[0].tolist() == [7, ord("a"), ord("b")]
    assert batch.response_ids[0].tolist() == [ord("c"), 1]
