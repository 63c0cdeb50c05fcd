"""gpt-oss's chat format, OpenAI harmony, through ``openai-harmony``: chat prompts rendered and outputs parsed into
reasoning, content and tool calls.

gpt-oss is trained on harmony, not on a chat template of text: a conversation is a list of messages, each
``<|start|>{role}[ to={recipient}]<|channel|>{channel}[ <|constrain|>{format}]<|message|>{text}<|end|>``, the
assistant's thinking goes to the ``analysis`` channel, its answer to ``final``, and a tool call is a ``commentary``
message addressed ``to=functions.{name}`` whose text is the JSON arguments, ended by ``<|call|>`` instead of
``<|end|>`` (an answer ends with ``<|return|>``). The tools are declared in the developer message as a TypeScript-like
``namespace functions``, the reasoning effort in the system message. ``openai-harmony`` (OpenAI's library, the one
vLLM and SGLang serve gpt-oss with) renders and parses this; this module maps the OpenAI chat API onto it:

* **Prompt** (:meth:`HarmonyChat.render`): ``system`` / ``developer`` messages become the developer message's
  instructions, ``tools`` its function tools (not with ``tool_choice`` ``none``), ``reasoning_effort`` the system
  message's; ``user`` turns are user messages; an earlier assistant turn's text is a ``final`` message and each of its
  ``tool_calls`` a ``commentary`` call; a ``tool`` turn is a message from ``functions.{name}`` (the name found from
  its ``tool_call_id``). The prompt ends ``<|start|>assistant``: the model writes the channel itself. A request
  whose output is constrained by a grammar (``response_format``, ``regex``, ``ebnf``) gets a prompt that ends
  inside a ``final`` message instead, so the constrained text is the answer.
* **Output** (:class:`HarmonyStream`): the generated token ids go through ``StreamableParser``; ``analysis`` text
  streams as ``reasoning_content``, ``final`` (and ``commentary`` without a recipient: a preamble) as ``content``,
  and a call to one of the request's tools becomes a ``tool_calls`` entry when its message ends (arguments that are
  not a JSON object, or a name that is not a tool, stay text, as in ``raymoe.deploy.tool_calls``). Output the parser
  cannot read as harmony is shown as content, whole, when the answer ends.

The encoding needs the ``o200k_base`` vocabulary, which ``openai-harmony`` downloads on first use, or reads from the
folder ``TIKTOKEN_ENCODINGS_BASE`` names (for machines without internet access); it is used only where the model's
own tokenizer agrees with it (its special tokens at harmony's ids), since the ranks decode with the checkpoint's.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from functools import lru_cache

from raymoe.deploy.protocol import ChatCompletionRequest
from raymoe.deploy.reasoning import ReasoningSplit
from raymoe.deploy.tool_calls import ToolCall, make_tool_call
from raymoe.errors import CheckpointError

log = logging.getLogger(__name__)

REASONING_EFFORTS = ("low", "medium", "high")
"""``reasoning_effort`` values harmony's system message takes."""

HARMONY_SPECIAL_IDS = {"<|return|>": 200002, "<|channel|>": 200005, "<|start|>": 200006, "<|end|>": 200007,
                       "<|message|>": 200008, "<|call|>": 200012}
"""Harmony's special tokens a chat uses, at their ids in ``o200k_harmony`` (checked against the encoding too)."""


@lru_cache(maxsize=1)
def harmony_encoding():
    """gpt-oss's ``HarmonyEncoding`` (loaded once per process).

    Raises:
        ImportError: ``openai-harmony`` is not installed. CheckpointError: its vocabulary could not be loaded
            (no network and no ``TIKTOKEN_ENCODINGS_BASE`` folder holding ``o200k_base.tiktoken``).
    """
    import openai_harmony as oh

    try:
        return oh.load_harmony_encoding(oh.HarmonyEncodingName.HARMONY_GPT_OSS)
    except oh.HarmonyError as e:
        raise CheckpointError("o200k_base", f"openai-harmony could not load gpt-oss's vocabulary ({e}); put "
                                            "o200k_base.tiktoken in a folder and name it in TIKTOKEN_ENCODINGS_BASE"
                              ) from e


class HarmonyChat:
    """Harmony prompts and outputs of one served gpt-oss model (module docstring).

    Args:
        encoding: the ``HarmonyEncoding``.
    """

    def __init__(self, encoding):
        import openai_harmony as oh

        self.oh = oh
        self.encoding = encoding
        self.stop_token_ids = tuple(encoding.stop_tokens_for_assistant_actions())  # <|return|>, <|call|>

    @classmethod
    def for_tokenizer(cls, tokenizer) -> HarmonyChat | None:
        """The harmony chat of a model with this tokenizer (the family is the caller's choice:
        ``raymoe.deploy.tool_calls.default_tool_parser`` names harmony for gpt-oss), or None where it cannot speak
        harmony: a tokenizer whose special tokens are not harmony's, or ``openai-harmony`` not installed (logged).

        Raises:
            CheckpointError: the vocabulary cannot be loaded, or openai-harmony's special ids are not the tokenizer's.
        """
        for token, want in HARMONY_SPECIAL_IDS.items():  # before the vocabulary is loaded (a download)
            if tokenizer.convert_tokens_to_ids(token) != want:
                log.warning("the tokenizer's %s is not harmony's id %d: chats use the checkpoint's chat template",
                            token, want)
                return None
        try:
            encoding = harmony_encoding()
        except ImportError:
            log.warning("openai-harmony is not installed: the chat template renders harmony chats and tool calls "
                        "are not parsed (pip install openai-harmony)")
            return None
        if any(encoding.encode(t, allowed_special="all") != [i] for t, i in HARMONY_SPECIAL_IDS.items()):
            raise CheckpointError("o200k_harmony", "openai-harmony's special token ids differ from the ones "
                                                   "gpt-oss's tokenizer uses")
        return cls(encoding)

    def render(self, req: ChatCompletionRequest, constrained: bool = False) -> list[int]:
        """The prompt of a chat request as token ids (module docstring). ``constrained``: the output follows a
        grammar, so the prompt opens the ``final`` message.

        Raises:
            ValueError: a ``tool`` turn answers a call id no earlier assistant turn made (names ``messages``), or
                ``reasoning_effort`` is not one of :data:`REASONING_EFFORTS`.
        """
        oh = self.oh
        system = oh.SystemContent.new()
        effort = req.reasoning_effort
        if effort is not None:
            if effort not in REASONING_EFFORTS:
                raise ValueError(f"reasoning_effort must be one of {', '.join(REASONING_EFFORTS)}, got {effort!r}")
            system = system.with_reasoning_effort(oh.ReasoningEffort(effort.capitalize()))
        instructions = "\n\n".join(m.text() for m in req.messages if m.role in ("system", "developer"))
        developer = oh.DeveloperContent.new()
        if instructions:
            developer = developer.with_instructions(instructions)
        if req.tools and req.tool_choice != "none":
            developer = developer.with_function_tools([
                oh.ToolDescription.new(t.function.name, t.function.description or "", parameters=t.function.parameters)
                for t in req.tools])
        messages = [oh.Message.from_role_and_content(oh.Role.SYSTEM, system)]
        if instructions or (req.tools and req.tool_choice != "none"):
            messages.append(oh.Message.from_role_and_content(oh.Role.DEVELOPER, developer))
        call_names: dict[str, str] = {}
        for m in req.messages:
            if m.role == "user":
                messages.append(oh.Message.from_role_and_content(oh.Role.USER, m.text()))
            elif m.role == "assistant":
                if m.text():
                    messages.append(oh.Message.from_role_and_content(oh.Role.ASSISTANT, m.text()).with_channel("final"))
                for call in m.tool_calls or ():
                    call_names[call.id] = call.function.name
                    messages.append(oh.Message.from_role_and_content(oh.Role.ASSISTANT, call.function.arguments)
                                    .with_channel("commentary").with_recipient(f"functions.{call.function.name}")
                                    .with_content_type("<|constrain|>json"))
            elif m.role == "tool":
                name = call_names.get(m.tool_call_id or "")
                if name is None:
                    raise ValueError(f"a tool message answers call {m.tool_call_id!r}, which no earlier assistant "
                                     "message made")
                author = oh.Author.new(oh.Role.TOOL, f"functions.{name}")
                messages.append(oh.Message.from_author_and_content(author, m.text()).with_channel("commentary")
                                .with_recipient("assistant"))
        ids = self.encoding.render_conversation_for_completion(oh.Conversation.from_messages(messages),
                                                                oh.Role.ASSISTANT)
        if constrained:
            ids = list(ids) + self.encoding.encode("<|channel|>final<|message|>", allowed_special="all")
        return [int(t) for t in ids]

    def stream(self, tool_names: frozenset[str] | None) -> HarmonyStream:
        """A parser for one answer; ``tool_names``: the request's tools (None: calls stay text)."""
        return HarmonyStream(self, tool_names or frozenset())


class HarmonyStream:
    """Parses one answer's token ids as they arrive (module docstring).

    Args:
        chat: the model's :class:`HarmonyChat`. tool_names: the request's tools.
    """

    def __init__(self, chat: HarmonyChat, tool_names: frozenset[str]):
        self.chat = chat
        self.tool_names = tool_names
        self._parser = chat.oh.StreamableParser(chat.encoding, chat.oh.Role.ASSISTANT)
        self._tokens: list[int] = []  # everything generated, for output that is not harmony
        self._broken_at: int | None = None  # index of the first token the parser refused: from it on, text
        self._shown = False  # some text went out as reasoning or content

    def feed(self, token_ids: Sequence[int]) -> ReasoningSplit:
        """The reasoning and content text of the next generated tokens (a tool call's arguments are held)."""
        reasoning, content = [], []
        for t in token_ids:
            self._tokens.append(t)
            if self._broken_at is not None:
                continue
            try:
                self._parser.process(t)
            except self.chat.oh.HarmonyError:
                self._broken_at = len(self._tokens) - 1
                continue
            delta = self._parser.last_content_delta
            if not delta or self._parser.current_recipient is not None:
                continue
            (reasoning if self._parser.current_channel == "analysis" else content).append(delta)
            self._shown = True
        return ReasoningSplit("".join(reasoning), "".join(content))

    def finish(self) -> tuple[ReasoningSplit, tuple[ToolCall, ...]]:
        """The answer ended: what is left to show and its tool calls."""
        oh = self.chat.oh
        stops = self.chat.stop_token_ids
        # the tokens from one the parser refused come out as text; an answer that ended inside a header ends there;
        # one that was not harmony at all comes out whole
        tail_from = self._broken_at
        if tail_from is None and self._parser.state != oh.StreamState.EXPECT_START:
            try:
                self._parser.process_eos()
            except oh.HarmonyError:
                tail_from = len(self._tokens)
        if tail_from is not None and not self._shown and not self._parser.messages:
            tail_from = 0
        calls, content = [], []
        for m in self._parser.messages:
            if m.recipient is None or not m.recipient.startswith("functions."):
                continue
            text = "".join(getattr(c, "text", "") for c in m.content)
            call = make_tool_call(m.recipient.removeprefix("functions."), text, self.tool_names)
            if call is None:
                content.append(text)
            else:
                calls.append(call)
        if tail_from is not None:
            content.append(self.chat.encoding.decode([t for t in self._tokens[tail_from:] if t not in stops]))
        return ReasoningSplit("", "".join(content)), tuple(calls)

