"""The structural limits of a request body: what the body parser checks while it parses, before anything is built.

:class:`BodyLimits` is the record the parser works from (``body_shape``, ``body_parse``, and the parse worker
processes of ``parse_pool``, which get it with each body). Its values are operator settings, declared (with their
help and flags) as fields of ``raymoe.deploy.server_config.ServerLimits``, which makes one of these with
:meth:`ServerLimits.body_limits`; the defaults are declared here, once. The ``CAP_*`` constants are the most an
operator may allow; the request schema (``protocol``) carries them as its static bounds.

This module imports nothing heavy (no torch, no Ray), so that a parse worker starts in a fraction of a second.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

# Most chat messages an operator may allow in one request.
CAP_MESSAGES = 4096
# Most content parts an operator may allow in one message.
CAP_MESSAGE_PARTS = 4096
# Most logit_bias entries an operator may allow.
CAP_LOGIT_BIAS = 1 << 16
MAX_BATCH_PROMPTS = 128
"""Most prompts in one completion request (a batch; each prompt's choices are engine requests of their own)."""
# Most token ids an operator may allow in one token-id prompt (the context length is checked after parsing).
CAP_PROMPT_TOKEN_IDS = 1 << 20
# Deepest JSON nesting an operator may allow (the decoder's own recursion guard sits above it).
CAP_JSON_DEPTH = 512


@dataclass(frozen=True)
class BodyLimits:
    """Structural limits of one request body; each one's help is on the matching ``ServerLimits`` field.

    Attributes:
        max_messages: chat messages per request. max_message_parts: content parts per chat message.
        max_logit_bias: ``logit_bias`` entries. max_prompt_token_ids: token ids per prompt (a flat token-id
            prompt, or the one token list of a list prompt). max_json_depth: nesting levels of arrays and objects,
            counting the body itself as level 1.

    Raises:
        ValueError: a limit is not an integer in ``[1, its CAP_*]``.
    """

    max_messages: int = 4096
    max_message_parts: int = 256
    max_logit_bias: int = 300
    max_prompt_token_ids: int = CAP_PROMPT_TOKEN_IDS
    max_json_depth: int = 64

    def __post_init__(self) -> None:
        for f in fields(self):
            v, cap = getattr(self, f.name), CAPS[f.name]
            if not isinstance(v, int) or isinstance(v, bool) or not 1 <= v <= cap:
                raise ValueError(f"{f.name} must be an integer in [1, {cap}], got {v!r}")


CAPS = {"max_messages": CAP_MESSAGES, "max_message_parts": CAP_MESSAGE_PARTS, "max_logit_bias": CAP_LOGIT_BIAS,
        "max_prompt_token_ids": CAP_PROMPT_TOKEN_IDS, "max_json_depth": CAP_JSON_DEPTH}
"""Each ``BodyLimits`` field's largest allowed value."""


@dataclass(frozen=True)
class Refusal:
    """What the body parser answers instead of a request (the front end turns it into an ``APIError``; a plain record
    so that it crosses the parse worker's pipe).

    Attributes:
        message: for the client. param: the offending field (``None``: the body as a whole). code: machine readable
            code. status: HTTP status.
    """

    message: str
    param: str | None = None
    code: str | None = "invalid_value"
    status: int = 400
