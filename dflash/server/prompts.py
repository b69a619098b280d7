"""Turn a validated request into the retained prompt tokens (chat template + context policy)."""

import threading
from dataclasses import dataclass
from typing import Any, Dict, List, Optional

from .policy import SHIFT, ContextTooLong, shift_chat, shift_raw
from .protocol import CHAT, APIError, GenerationRequest, invalid


@dataclass
class Prepared:
    """A request's retained prompt.

    Attributes:
        tokens: The prompt tokens to generate from.
        dropped_turns: Oldest chat turns dropped (chat).
        dropped_tokens: Middle tokens dropped (raw completions).
        messages: The retained chat messages (chat).
    """

    tokens: List[int]
    dropped_turns: int = 0
    dropped_tokens: int = 0
    messages: Optional[List[Dict[str, Any]]] = None

    @property
    def dropped(self) -> int:
        """What the policy left out (turns for chat, tokens for raw prompts)."""
        return self.dropped_turns or self.dropped_tokens


class Prompter:
    """Renders prompts and applies the context policy; safe to call from several threads.

    Args:
        tokenizer: The model's ``TokenizerWrapper``.
        max_context: The context limit (``None``: unlimited).
        policy: ``"shift"`` or ``"error"``.
        raw_keep: Leading tokens a shifted raw prompt always keeps.
        template_args: ``--chat-template-args``.
    """

    def __init__(
        self,
        tokenizer,
        max_context: Optional[int],
        policy: str = SHIFT,
        raw_keep: int = 0,
        template_args: Optional[Dict[str, Any]] = None,
    ):
        self.tokenizer = tokenizer
        self.max_context = max_context
        self.policy = policy
        self.raw_keep = raw_keep
        self.template_args = dict(template_args or {})
        # Hugging Face tokenizers are not safe to use from several threads at once.
        self._lock = threading.Lock()

    def prepare(self, request: GenerationRequest) -> Prepared:
        """The retained prompt of a request.

        Raises:
            APIError: 400 when the prompt cannot be rendered or cannot fit the context.
        """
        with self._lock:
            try:
                if request.kind == CHAT:
                    return self._chat(request)
                return self._raw(request)
            except ContextTooLong as error:
                raise APIError(
                    400,
                    str(error),
                    param="messages" if request.kind == CHAT else "prompt",
                    code="context_length_exceeded",
                )

    def render(
        self, messages: List[Dict[str, Any]], request: GenerationRequest
    ) -> List[int]:
        """Prompt tokens of a message list: the chat template, or mlx-lm's plain chat format.

        Args:
            messages: Normalized chat messages.
            request: Supplies ``tools``, ``chat_template_kwargs`` and ``role_mapping``.

        Returns:
            The token ids, ready for generation (generation prompt appended).
        """
        tokenizer = self.tokenizer
        if not getattr(tokenizer, "has_chat_template", False):
            from mlx_lm.server import convert_chat

            return list(tokenizer.encode(convert_chat(messages, request.role_mapping)))
        kwargs = dict(self.template_args)
        kwargs.update(request.chat_template_kwargs or {})
        try:
            tokens = tokenizer.apply_chat_template(
                messages,
                tools=request.tools,
                add_generation_prompt=True,
                tokenize=True,
                **kwargs,
            )
        except Exception as error:  # jinja raises for conversations a template refuses
            raise invalid(
                f"the chat template could not render the messages: {error}", "messages"
            )
        if isinstance(tokens, dict):  # some tokenizers return a BatchEncoding
            tokens = tokens["input_ids"]
        return [int(token) for token in tokens]

    def _chat(self, request: GenerationRequest) -> Prepared:
        rendered: Dict[int, List[int]] = {}

        def count(messages: List[Dict[str, Any]]) -> int:
            # Each dropped turn removes at least one message, so the length is a unique key.
            rendered[len(messages)] = self.render(messages, request)
            return len(rendered[len(messages)])

        shift = shift_chat(
            request.messages, count, self.max_context, request.max_tokens, self.policy
        )
        tokens = rendered[len(shift.messages)]
        _check_not_empty(tokens)
        return Prepared(
            tokens, dropped_turns=shift.dropped_turns, messages=shift.messages
        )

    def _raw(self, request: GenerationRequest) -> Prepared:
        prompt = request.prompt
        tokens = (
            list(self.tokenizer.encode(prompt))
            if isinstance(prompt, str)
            else list(prompt)
        )
        _check_not_empty(tokens)
        shift = shift_raw(
            tokens, self.max_context, request.max_tokens, self.raw_keep, self.policy
        )
        return Prepared(shift.tokens, dropped_tokens=shift.dropped_tokens)


def _check_not_empty(tokens: List[int]) -> None:
    if not tokens:
        raise invalid("the prompt is empty after tokenization", "messages")
