"""The OpenAI wire format: request validation, response bodies and error bodies.

Validation is strict about the fields it knows (a wrong type or an out-of-range value is a 400
naming the field) and ignores the fields it does not know, as OpenAI-compatible servers do, so
clients that send extra fields (``user``, ``metadata``, ...) keep working.
"""

import json
import math
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Tuple, Union

CHAT = "chat"
TEXT = "text"

# Fields whose non-default values change the output in ways this server cannot honour.
_UNSUPPORTED = {
    "echo": False,
    "suffix": None,
}


class APIError(Exception):
    """An HTTP error with an OpenAI-style body.

    Args:
        status: The HTTP status code.
        message: What went wrong, for the client.
        kind: The OpenAI error ``type`` (``invalid_request_error``, ``server_error``, ...).
        param: The request field at fault, if any.
        code: A short machine-readable code, if any.
        headers: Extra response headers (e.g. ``Retry-After``).
    """

    def __init__(
        self,
        status: int,
        message: str,
        kind: str = "invalid_request_error",
        param: Optional[str] = None,
        code: Optional[str] = None,
        headers: Optional[Dict[str, str]] = None,
    ):
        super().__init__(message)
        self.status = status
        self.message = message
        self.kind = kind
        self.param = param
        self.code = code
        self.headers = headers or {}

    def body(self) -> Dict[str, Any]:
        """The JSON body: ``{"error": {"message", "type", "param", "code"}}``."""
        return error_body(self.message, self.kind, self.param, self.code)


def error_body(
    message: str, kind: str, param: Optional[str] = None, code: Optional[str] = None
) -> Dict[str, Any]:
    """An OpenAI-style error body."""
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def invalid(message: str, param: Optional[str] = None) -> APIError:
    """A 400 ``invalid_request_error``."""
    return APIError(400, message, param=param)


def _reject_constant(name: str):
    raise ValueError(f"{name} is not valid JSON")


def parse_json(raw: bytes) -> Dict[str, Any]:
    """Decode a request body; a 400 unless it is a JSON object.

    Args:
        raw: The body bytes.

    Returns:
        The decoded object.
    """
    try:
        body = json.loads(raw.decode("utf-8"), parse_constant=_reject_constant)
    except UnicodeDecodeError as err:
        raise invalid(f"the request body is not UTF-8: {err}")
    except ValueError as err:
        raise invalid(f"invalid JSON in the request body: {err}")
    if not isinstance(body, dict):
        raise invalid(
            f"the request body must be a JSON object, got {type(body).__name__}"
        )
    return body


# ------------------------------------------------------------------------------ field checks
def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return (_is_int(value) or isinstance(value, float)) and math.isfinite(value)


def _type_name(value: Any) -> str:
    return "null" if value is None else type(value).__name__


def get_int(body, name, default, low=None, high=None, nullable=True) -> Optional[int]:
    """An integer field (booleans refused) within ``[low, high]``; ``default`` when absent."""
    value = body.get(name)
    if value is None:
        if name in body and not nullable:
            raise invalid(f"{name} must be an integer, got null", name)
        return default
    if not _is_int(value):
        raise invalid(f"{name} must be an integer, got {_type_name(value)}", name)
    _check_range(name, value, low, high)
    return value


def get_number(body, name, default, low=None, high=None) -> Optional[float]:
    """A finite number field within ``[low, high]``; ``default`` when absent or null."""
    value = body.get(name)
    if value is None:
        return default
    if not _is_number(value):
        raise invalid(f"{name} must be a number, got {_type_name(value)}", name)
    _check_range(name, value, low, high)
    return float(value)


def get_bool(body, name, default) -> bool:
    """A boolean field; ``default`` when absent or null."""
    value = body.get(name)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise invalid(f"{name} must be a boolean, got {_type_name(value)}", name)
    return value


def get_object(body, name) -> Optional[Dict[str, Any]]:
    """A JSON-object field, or ``None`` when absent or null."""
    value = body.get(name)
    if value is not None and not isinstance(value, dict):
        raise invalid(f"{name} must be an object, got {_type_name(value)}", name)
    return value


def _check_range(name, value, low, high) -> None:
    if low is not None and value < low:
        raise invalid(f"{name} must be >= {low}, got {value}", name)
    if high is not None and value > high:
        raise invalid(f"{name} must be <= {high}, got {value}", name)


def _stop_words(body) -> List[str]:
    value = body.get("stop")
    if value is None:
        return []
    words = [value] if isinstance(value, str) else value
    if not isinstance(words, list) or not all(isinstance(word, str) for word in words):
        raise invalid("stop must be a string or a list of strings", "stop")
    if any(word == "" for word in words):
        raise invalid("stop strings must not be empty", "stop")
    return words


def _logit_bias(body, vocab_size: int) -> Optional[Dict[int, float]]:
    value = get_object(body, "logit_bias")
    if not value:
        return None
    bias = {}
    for key, amount in value.items():
        try:
            token = int(key)
        except ValueError:
            raise invalid(
                f"logit_bias keys must be token ids, got {key!r}", "logit_bias"
            )
        if not 0 <= token < vocab_size:
            raise invalid(
                f"logit_bias token {token} is outside the vocabulary", "logit_bias"
            )
        if not _is_number(amount):
            raise invalid(
                f"logit_bias values must be numbers, got {amount!r}", "logit_bias"
            )
        bias[token] = float(amount)
    return bias


# ------------------------------------------------------------------------------ requests
@dataclass
class Defaults:
    """The server's defaults for fields a request leaves out (mlx_lm.server's flags).

    Attributes:
        max_tokens: ``--max-tokens``.
        temperature: ``--temp``.
        top_p: ``--top-p``.
        top_k: ``--top-k``.
        min_p: ``--min-p``.
        num_draft_tokens: ``--num-draft-tokens``.
        vocab_size: The model's vocabulary (bounds token ids).
    """

    max_tokens: int = 512
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    num_draft_tokens: int = 3
    vocab_size: int = 1 << 31


@dataclass
class GenerationRequest:
    """A validated completion request.

    Attributes:
        kind: ``"chat"`` or ``"text"``.
        model: The requested model name (``None``: the served one).
        draft_model: The requested draft model name (``None``: the served one).
        stream: Server-sent events instead of one body.
        include_usage: Send a final usage chunk when streaming.
        max_tokens: Tokens to generate at most (also the context policy's output reserve).
        temperature: Sampling temperature (0: greedy).
        top_p: Nucleus sampling.
        top_k: Top-k sampling (0: off).
        min_p: Min-p sampling (0: off).
        xtc_probability: XTC sampling probability (0: off).
        xtc_threshold: XTC threshold.
        seed: PRNG seed for this request.
        stop: Stop strings (the text ends before the first one).
        logprobs: Return the chosen tokens' log-probabilities.
        top_logprobs: Alternatives per position to return.
        num_draft_tokens: Draft tokens per round with a classic draft model.
        penalties: Keyword arguments of ``mlx_lm.sample_utils.make_logits_processors``.
        messages: The chat messages (``kind == "chat"``).
        tools: Tool definitions for the chat template.
        chat_template_kwargs: Extra chat template arguments.
        role_mapping: Role prefixes for models without a chat template.
        prompt: The raw prompt, text or token ids (``kind == "text"``).
    """

    kind: str
    model: Optional[str] = None
    draft_model: Optional[str] = None
    stream: bool = False
    include_usage: bool = False
    max_tokens: int = 512
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    xtc_probability: float = 0.0
    xtc_threshold: float = 0.1
    seed: Optional[int] = None
    stop: List[str] = field(default_factory=list)
    logprobs: bool = False
    top_logprobs: int = 0
    num_draft_tokens: int = 3
    penalties: Dict[str, Any] = field(default_factory=dict)
    messages: List[Dict[str, Any]] = field(default_factory=list)
    tools: Optional[List[Any]] = None
    chat_template_kwargs: Optional[Dict[str, Any]] = None
    role_mapping: Optional[Dict[str, Any]] = None
    prompt: Union[str, List[int], None] = None


def parse_request(
    body: Dict[str, Any], kind: str, defaults: Defaults
) -> GenerationRequest:
    """Validate a decoded chat or completions body.

    Args:
        body: The decoded JSON object.
        kind: ``"chat"`` or ``"text"``.
        defaults: The server's defaults.

    Returns:
        The request, every field checked.

    Raises:
        APIError: 400 naming the first bad field.
    """
    request = GenerationRequest(kind=kind)
    for name in ("model", "draft_model"):
        value = body.get(name)
        if value is not None and not isinstance(value, str):
            raise invalid(f"{name} must be a string, got {_type_name(value)}", name)
        setattr(request, name, value)
    request.stream = get_bool(body, "stream", False)
    options = get_object(body, "stream_options") or {}
    request.include_usage = get_bool(options, "include_usage", False)
    max_tokens = get_int(body, "max_completion_tokens", None, low=1)
    if max_tokens is None:
        max_tokens = get_int(body, "max_tokens", defaults.max_tokens, low=1)
    request.max_tokens = max_tokens
    request.temperature = get_number(body, "temperature", defaults.temperature, low=0)
    request.top_p = get_number(body, "top_p", defaults.top_p, low=0, high=1)
    request.top_k = get_int(body, "top_k", defaults.top_k, low=0)
    request.min_p = get_number(body, "min_p", defaults.min_p, low=0, high=1)
    request.xtc_probability = get_number(body, "xtc_probability", 0.0, low=0, high=1)
    request.xtc_threshold = get_number(body, "xtc_threshold", 0.1, low=0, high=0.5)
    request.seed = get_int(body, "seed", None)
    request.stop = _stop_words(body)
    request.num_draft_tokens = get_int(
        body, "num_draft_tokens", defaults.num_draft_tokens, low=0
    )
    get_int(body, "n", 1, low=1, high=1)
    get_int(body, "best_of", 1, low=1, high=1)
    _parse_logprobs(body, kind, request)
    request.penalties = _penalties(body, defaults.vocab_size)
    _refuse_unsupported(body)
    if kind == CHAT:
        _parse_chat(body, request)
    else:
        _parse_text(body, request, defaults.vocab_size)
    return request


def _parse_logprobs(body, kind: str, request: GenerationRequest) -> None:
    value = body.get("logprobs")
    if kind == TEXT and _is_int(value):
        # The completions API gives the number of alternatives in ``logprobs``.
        _check_range("logprobs", value, 0, 20)
        request.logprobs, request.top_logprobs = True, value
        return
    request.logprobs = get_bool(body, "logprobs", False)
    request.top_logprobs = get_int(body, "top_logprobs", 0, low=0, high=20)
    if request.top_logprobs and not request.logprobs:
        raise invalid("top_logprobs needs logprobs set to true", "top_logprobs")


def _penalties(body, vocab_size: int) -> Dict[str, Any]:
    penalties = {"logit_bias": _logit_bias(body, vocab_size)}
    for name in ("repetition_penalty", "presence_penalty", "frequency_penalty"):
        low = 0 if name == "repetition_penalty" else None
        penalties[name] = get_number(body, name, None, low=low)
    for name in ("repetition", "presence", "frequency"):
        key = f"{name}_context_size"
        penalties[key] = get_int(body, key, 20, low=0)
    # 0 (mlx_lm.server's default) and 1 both mean no repetition penalty.
    if penalties["repetition_penalty"] in (0.0, 1.0):
        penalties["repetition_penalty"] = None
    return penalties


def _refuse_unsupported(body) -> None:
    for name, neutral in _UNSUPPORTED.items():
        value = body.get(name)
        if value is not None and value != neutral:
            raise invalid(f"{name}={value!r} is not supported by this server", name)
    response_format = get_object(body, "response_format")
    if response_format and response_format.get("type", "text") != "text":
        raise invalid(
            "response_format other than {'type': 'text'} is not supported",
            "response_format",
        )


def _parse_chat(body, request: GenerationRequest) -> None:
    messages = body.get("messages")
    if messages is None:
        raise invalid("messages is required", "messages")
    if not isinstance(messages, list) or not messages:
        raise invalid(
            "messages must be a non-empty list of message objects", "messages"
        )
    request.messages = [
        normalize_message(message, i) for i, message in enumerate(messages)
    ]
    tools = body.get("tools")
    if tools is not None and not isinstance(tools, list):
        raise invalid(f"tools must be a list, got {_type_name(tools)}", "tools")
    request.tools = tools or None
    request.chat_template_kwargs = get_object(body, "chat_template_kwargs")
    request.role_mapping = get_object(body, "role_mapping")


def normalize_message(message: Any, index: int) -> Dict[str, Any]:
    """Check one chat message and put it in the form chat templates expect.

    Text-part lists become one string, a null content becomes ``""`` and tool-call arguments
    given as JSON text become objects (as ``mlx_lm.server`` passes them to templates).

    Args:
        message: The message as sent.
        index: Its position (for error messages).

    Returns:
        A new dict; the request's own message is not modified.
    """
    where = f"messages[{index}]"
    if not isinstance(message, dict):
        raise invalid(
            f"{where} must be an object, got {_type_name(message)}", "messages"
        )
    role = message.get("role")
    if not isinstance(role, str) or not role:
        raise invalid(f"{where}.role must be a non-empty string", "messages")
    normalized = dict(message)
    normalized["content"] = _content_text(message.get("content"), where)
    if message.get("tool_calls") is not None:
        normalized["tool_calls"] = _tool_calls(message["tool_calls"], where)
    for name in ("name", "tool_call_id"):
        if (
            name in message
            and message[name] is not None
            and not isinstance(message[name], str)
        ):
            raise invalid(f"{where}.{name} must be a string", "messages")
    return normalized


def _content_text(content: Any, where: str) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text":
                raise invalid(
                    f"{where}.content: only text parts are supported", "messages"
                )
            if not isinstance(part.get("text"), str):
                raise invalid(
                    f"{where}.content: a text part needs a string 'text'", "messages"
                )
            texts.append(part["text"])
        return "".join(texts)
    raise invalid(
        f"{where}.content must be a string or a list of text parts, got {_type_name(content)}",
        "messages",
    )


def _tool_calls(calls: Any, where: str) -> List[Dict[str, Any]]:
    if not isinstance(calls, list):
        raise invalid(f"{where}.tool_calls must be a list", "messages")
    normalized = []
    for call in calls:
        if not isinstance(call, dict):
            raise invalid(f"{where}.tool_calls entries must be objects", "messages")
        call = dict(call)
        function = call.get("function")
        if function is not None:
            if not isinstance(function, dict):
                raise invalid(
                    f"{where}.tool_calls[].function must be an object", "messages"
                )
            function = dict(function)
            arguments = function.get("arguments")
            if isinstance(arguments, str):
                try:
                    function["arguments"] = json.loads(arguments)
                except ValueError:
                    raise invalid(
                        f"{where}.tool_calls[].function.arguments is not valid JSON",
                        "messages",
                    )
            call["function"] = function
        normalized.append(call)
    return normalized


def _parse_text(body, request: GenerationRequest, vocab_size: int) -> None:
    prompt = body.get("prompt")
    if prompt is None:
        raise invalid("prompt is required", "prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        prompt = prompt[0]
    if isinstance(prompt, str):
        if not prompt:
            raise invalid("prompt must not be empty", "prompt")
        request.prompt = prompt
        return
    if isinstance(prompt, list) and prompt and all(_is_int(token) for token in prompt):
        if not all(0 <= token < vocab_size for token in prompt):
            raise invalid("prompt token ids must be within the vocabulary", "prompt")
        request.prompt = list(prompt)
        return
    raise invalid(
        "prompt must be a non-empty string or a non-empty list of token ids (one prompt)",
        "prompt",
    )


# ------------------------------------------------------------------------------ responses
@dataclass
class Usage:
    """Token counts of one completion.

    Attributes:
        prompt_tokens: Tokens of the retained prompt.
        completion_tokens: Tokens generated.
        cached_tokens: Prompt tokens found in the cache (not prefilled again).
    """

    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int

    def body(self) -> Dict[str, Any]:
        return {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "total_tokens": self.prompt_tokens + self.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": self.cached_tokens},
        }


@dataclass
class Envelope:
    """The fields every body of one response shares.

    Attributes:
        kind: ``"chat"`` or ``"text"``.
        model: The model name echoed back.
        fingerprint: The ``system_fingerprint``.
        id: The completion id.
        created: Unix time of the request.
    """

    kind: str
    model: str
    fingerprint: str
    id: str = ""
    created: int = 0

    def __post_init__(self):
        prefix = "chatcmpl" if self.kind == CHAT else "cmpl"
        self.id = self.id or f"{prefix}-{uuid.uuid4()}"
        self.created = self.created or int(time.time())

    def base(self, stream: bool) -> Dict[str, Any]:
        if self.kind == CHAT:
            kind = "chat.completion.chunk" if stream else "chat.completion"
        else:
            kind = "text_completion"
        return {
            "id": self.id,
            "object": kind,
            "created": self.created,
            "model": self.model,
            "system_fingerprint": self.fingerprint,
        }


def chat_logprobs(
    entries: List[Tuple[str, float, List[Tuple[str, float]]]],
) -> Dict[str, Any]:
    """The chat ``logprobs`` object from ``(token text, logprob, [(alt text, logprob)])``."""
    return {
        "content": [
            {
                "token": text,
                "logprob": logprob,
                "bytes": list(text.encode("utf-8")),
                "top_logprobs": [
                    {"token": alt, "logprob": lp, "bytes": list(alt.encode("utf-8"))}
                    for alt, lp in top
                ],
            }
            for text, logprob, top in entries
        ]
    }


def text_logprobs(
    entries: List[Tuple[str, float, List[Tuple[str, float]]]], offset: int = 0
) -> Dict[str, Any]:
    """The completions ``logprobs`` object (tokens, token_logprobs, top_logprobs, offsets)."""
    offsets, position = [], offset
    for text, _, _ in entries:
        offsets.append(position)
        position += len(text)
    return {
        "tokens": [text for text, _, _ in entries],
        "token_logprobs": [logprob for _, logprob, _ in entries],
        "top_logprobs": [dict(top) for _, _, top in entries],
        "text_offset": offsets,
    }


def choice(
    kind: str,
    stream: bool,
    text: Optional[str],
    finish_reason: Optional[str],
    logprobs: Optional[list] = None,
    first: bool = False,
    offset: int = 0,
) -> Dict[str, Any]:
    """One ``choices[0]`` entry of a chat or completions body or chunk."""
    entry: Dict[str, Any] = {
        "index": 0,
        "finish_reason": finish_reason,
        "logprobs": None,
    }
    if kind == CHAT:
        if stream:
            delta: Dict[str, Any] = {"role": "assistant"} if first else {}
            if text:
                delta["content"] = text
            entry["delta"] = delta
        else:
            entry["message"] = {"role": "assistant", "content": text}
        if logprobs:
            entry["logprobs"] = chat_logprobs(logprobs)
    else:
        entry["text"] = text or ""
        if logprobs:
            entry["logprobs"] = text_logprobs(logprobs, offset)
    return entry
