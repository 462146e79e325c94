"""A user message as the model's token ids: through the tokenizer's chat template when it
has one (`add_generation_prompt=True`: the ids end where the assistant's reply starts),
else the raw text. Tokenizers are Hugging Face-style (`encode`, and `chat_template` with
`apply_chat_template` for chat models). No JAX, no model: the text API, the evaluation
harness and the command line share it."""

from __future__ import annotations

from typing import Any


def uses_chat_template(tokenizer: Any) -> bool:
    """Whether ``tokenizer`` has a chat template (``None`` means raw text)."""
    return bool(getattr(tokenizer, "chat_template", None))


def encode_prompt(tokenizer, prompt: str, chat: bool = True) -> list[int]:
    """Token ids of `prompt`, through the tokenizer's chat template when it has one."""
    if chat and uses_chat_template(tokenizer):
        ids = tokenizer.apply_chat_template([{"role": "user", "content": prompt}],
                                            add_generation_prompt=True, tokenize=True)
        if isinstance(ids, dict) or hasattr(ids, "input_ids"):
            ids = ids["input_ids"]
        return list(ids)
    return tokenizer.encode(prompt)
