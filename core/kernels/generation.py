"""Generation helpers that every backend shares: encoding prompts, the ids that end a
response, and cutting a sampled response after its first EOS."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from alignzoo._lazy import lazy_import
from alignzoo.errors import UserError

if TYPE_CHECKING:
    import torch
else:
    torch = lazy_import("torch")


def encode_prompts(
    tokenizer: Any, prompts: list[str], extras: list[dict[str, Any]], add_special_tokens: bool
) -> tuple[list[list[int]], list[dict[str, Any]]]:
    """Each prompt's token ids (a UserError for one that encodes to none), and the extras (one
    empty dict per prompt when none were given)."""
    extras = list(extras) if extras else [{} for _ in prompts]
    if len(extras) != len(prompts):
        raise ValueError(f"{len(prompts)} prompts but {len(extras)} extras")
    prompt_tokens: list[list[int]] = tokenizer(
        list(prompts), add_special_tokens=add_special_tokens
    )["input_ids"]
    for i, ids in enumerate(prompt_tokens):
        if not ids:
            raise UserError(f"prompt {i} encodes to no tokens: {prompts[i]!r}")
    return prompt_tokens, extras


def eos_token_ids(tokenizer: Any, model: Any) -> list[int]:
    """The tokenizer's EOS plus any EOS ``model``'s generation config lists (a peft model's:
    its base model's)."""
    get_base = getattr(model, "get_base_model", None)
    owner = get_base() if callable(get_base) else model
    ids: list[int] = []
    if tokenizer.eos_token_id is not None:
        ids.append(int(tokenizer.eos_token_id))
    extra = getattr(getattr(owner, "generation_config", None), "eos_token_id", None)
    for token in [extra] if isinstance(extra, int) else list(extra or []):
        if int(token) not in ids:
            ids.append(int(token))
    if not ids:
        raise UserError("the tokenizer has no eos_token: generation could never stop")
    return ids


def cut_after_eos(
    response: torch.Tensor, eos_ids: list[int], pad: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Mask 1.0 up to and including the first EOS, 0.0 after; tokens after it become ``pad``."""
    is_eos = torch.isin(response, torch.tensor(eos_ids, device=response.device))
    after = (is_eos.long().cumsum(dim=1) - is_eos.long()) > 0  # strictly after the first EOS
    mask = (~after).float()
    return response.masked_fill(after, pad), mask
