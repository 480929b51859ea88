"""Prompt tokenization for the gateway: text and chat prompts to the served model's token ids.

A thin wrapper over the model's Hugging Face tokenizer so that the gateway, the ``Tokenize`` RPC
and the tests all produce exactly the ids the engine would produce for the same prompt.
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any, Mapping, Sequence

from protos.errors import InvalidRequest

CHAT_ROLES = ("system", "user", "assistant", "tool")


class PromptTokenizer:
    """Encodes prompts with the tokenizer stored in a model folder.

    Thread-safe: calls are serialised by a lock, because a Hugging Face fast tokenizer may
    reconfigure its Rust state on every call and fails with "Already borrowed" when two threads
    use it at once. The gateway calls it from worker threads to keep its event loop free.
    """

    def __init__(self, model_path: str | Path) -> None:
        from transformers import AutoTokenizer

        self._tokenizer = AutoTokenizer.from_pretrained(str(model_path))
        self._lock = threading.Lock()

    @property
    def vocab_size(self) -> int:
        """Number of token ids the tokenizer knows, added special tokens included."""
        return len(self._tokenizer)

    def encode_text(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of plain text, with the special tokens the tokenizer adds by default
        (unless ``add_special_tokens`` is false)."""
        with self._lock:
            return list(self._tokenizer.encode(text, add_special_tokens=add_special_tokens))

    def decode(self, token_ids: Sequence[int]) -> str:
        """The text of ``token_ids`` (special tokens included), as vLLM's ``/detokenize``."""
        with self._lock:
            return self._tokenizer.decode(list(token_ids))

    def token_strs(self, token_ids: Sequence[int]) -> list[str]:
        """Each id's token string, as the vocabulary spells it."""
        with self._lock:
            return list(self._tokenizer.convert_ids_to_tokens(list(token_ids)))

    @property
    def renders_tools(self) -> bool:
        """The chat template renders tools itself (it refers to ``tools``); otherwise the
        fronts render them with Baton's default (``gateway.tool_calls``)."""
        return "tools" in (self._tokenizer.chat_template or "")

    def encode_chat(self, messages: Sequence[tuple[str, str]],
                    continue_final_message: bool = False) -> list[int]:
        """Token ids of a conversation of ``(role, content)`` pairs (``encode_conversation``)."""
        return self.encode_conversation([{"role": role, "content": content}
                                         for role, content in messages],
                                        continue_final_message=continue_final_message)

    def encode_conversation(self, conversation: list[dict], tools: list[dict] | None = None,
                            add_generation_prompt: bool = True,
                            template_kwargs: Mapping[str, Any] | None = None,
                            continue_final_message: bool = False) -> list[int]:
        """Token ids of a conversation of chat-template messages (and the tools, for a template
        that renders them).

        Rendered with the model's chat template, given ``template_kwargs`` as more template
        variables (a request's ``chat_template_kwargs``, e.g. ``enable_thinking``; checked by
        ``gateway.validation.check_template_kwargs``), and the assistant's generation prompt
        appended (unless ``add_generation_prompt`` is false: a prefix of a longer conversation), then
        encoded without adding special tokens (the template already holds them). With
        ``continue_final_message`` the last message (the assistant's prefilled answer) is left
        open, without its end-of-turn tokens or a generation prompt, so the model continues it.
        Raises ``InvalidRequest`` when the model has no chat template or the template rejects
        the conversation. Roles are not checked here; see ``gateway.validation``.
        """
        import jinja2

        if not self._tokenizer.chat_template:
            raise InvalidRequest(
                "the served model's tokenizer has no chat template; "
                "send the prompt as text or token_ids instead of chat"
            )
        with self._lock:
            try:
                rendered = self._tokenizer.apply_chat_template(
                    conversation, tools=tools,
                    add_generation_prompt=add_generation_prompt and not continue_final_message,
                    continue_final_message=continue_final_message, tokenize=False,
                    **(template_kwargs or {}),
                )
            except (jinja2.TemplateError, ValueError) as e:
                raise InvalidRequest(
                    f"the model's chat template rejected the conversation: {e}; "
                    "check the order and roles of the chat messages"
                ) from e
            return list(self._tokenizer.encode(rendered, add_special_tokens=False))
