"""The one prompt encoder: text and chat messages -> the target's token ids, the way
`LLM.generate`, the server, eval and bench all send them (so their prompts are identical)."""

from __future__ import annotations

from draftsmith.errors import DraftsmithError


def encode_text(tokenizer, text: str) -> list[int]:
    """A plain-text prompt, with the tokenizer's special tokens (BOS where it adds one)."""
    return list(tokenizer(text, add_special_tokens=True)["input_ids"])


def encode_chat(tokenizer, messages: list[dict], target_id: str = "the target") -> list[int]:
    """The chat template with a generation prompt; an error when the target has none."""
    if not getattr(tokenizer, "chat_template", None):
        raise DraftsmithError(f"target {target_id!r} has no chat template; send plain prompts")
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)


def encode_messages(tokenizer, messages: list[dict]) -> list[int]:
    """Messages for a target with or without a chat template: the template when there is one,
    else the contents joined by blank lines as plain text (eval / bench on base models)."""
    if getattr(tokenizer, "chat_template", None):
        return encode_chat(tokenizer, messages)
    return encode_text(tokenizer, "\n\n".join(m["content"] for m in messages))
