"""The text side of an LLM: token ids to and from text, chat prompts and stop strings.

- :class:`LlmText`: a Hugging Face model folder's ``tokenizer.json`` (the ``tokenizers`` library) and
  its chat template (``chat_template.jinja``, or ``chat_template`` in ``tokenizer_config.json``),
  rendered with Jinja2 in a sandbox as ``transformers``' ``apply_chat_template`` does.
- :class:`TextStream`: new tokens in, text out as it becomes final: decoded incrementally (a window
  of tokens, so that a word split over tokens, or a character over byte tokens, comes out whole)
  and cut before the first stop string, holding back any tail that could begin one.
"""

from __future__ import annotations

import json
from pathlib import Path

#: most stop strings a request may give (as OpenAI's API allows)
MAX_STOPS = 4


def _token_text(v) -> str | None:
    """A special token as ``tokenizer_config.json`` writes it: a string or ``{"content": ...}``."""
    return v.get("content") if isinstance(v, dict) else v


#: the roles of OpenAI's chat messages
ROLES = ("system", "developer", "user", "assistant", "tool", "function")


def _role(i: int, m) -> str:
    if not isinstance(m, dict) or not isinstance(m.get("role"), str):
        raise ValueError(f"messages[{i}] must be an object with a string role")
    if m["role"] not in ROLES:
        raise ValueError(f"messages[{i}].role must be one of {', '.join(ROLES)}, not {m['role'][:40]!r}")
    return m["role"]


def valid_unicode(field: str, text: str) -> str:
    """``text``, refused when it holds a lone surrogate (JSON's ``"\\ud800"``: no UTF-8 for it), the
    error naming ``field`` and the character's place in it.

    Raises:
        ValueError: ``field is not valid Unicode (...)``."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ValueError(
            f"{field} is not valid Unicode (a lone surrogate at character {e.start}: bytes that are not UTF-8, "
            "as Python reads them, or a JSON escape of half a pair): is the input UTF-8?"
        ) from None
    return text


def _content(i: int, m: dict) -> str:
    """A message's text: a string, a list of text parts, or null or absent in an assistant turn (one
    with tool calls) only."""
    c = m.get("content")
    if c is None:
        if m["role"] != "assistant":
            raise ValueError(f"messages[{i}].content is required (a string) in a {m['role']} message")
        return ""
    if isinstance(c, list) and all(
        isinstance(x, dict) and x.get("type") == "text" and isinstance(x.get("text"), str) for x in c
    ):
        return valid_unicode(f"messages[{i}].content", "".join(x["text"] for x in c))
    if not isinstance(c, str):
        raise ValueError(f"messages[{i}].content must be a string or a list of text parts")
    return valid_unicode(f"messages[{i}].content", c)


class LlmText:
    """Encode, decode and build chat prompts for one model.

    Args:
        tokenizer: a ``tokenizers.Tokenizer``.
        chat_template: a Jinja2 template of ``messages`` (``[{"role", "content"}]``), or None.
        bos_token, eos_token: the special tokens' text, as the template names them.
    """

    def __init__(self, tokenizer, chat_template: str | None = None, bos_token: str = "", eos_token: str = ""):
        self.tokenizer, self.chat_template = tokenizer, chat_template
        self.bos_token, self.eos_token = bos_token or "", eos_token or ""
        self._template = None

    @classmethod
    def from_folder(cls, path: str | Path) -> LlmText | None:
        """The folder's tokenizer and chat template; None when it has no ``tokenizer.json``.

        Raises:
            ValueError: a ``tokenizer.json`` or ``tokenizer_config.json`` that does not load, or a
                chat template that does not compile.
        """
        path = Path(path)
        if not (path / "tokenizer.json").is_file():
            return None
        from tokenizers import Tokenizer

        try:
            tok = Tokenizer.from_file(str(path / "tokenizer.json"))
            conf = path / "tokenizer_config.json"
            cfg = json.loads(conf.read_text(encoding="utf-8")) if conf.is_file() else {}
        except (OSError, ValueError, Exception) as e:  # (tokenizers raises its own Exception type)
            raise ValueError(f"the tokenizer in {path} does not load: {e}") from None
        template = cfg.get("chat_template")
        if isinstance(template, list):  # named templates: the default one
            template = next((t.get("template") for t in template if t.get("name") == "default"), None)
        jinja = path / "chat_template.jinja"
        if jinja.is_file():
            template = jinja.read_text(encoding="utf-8")
        text = cls(tok, template, _token_text(cfg.get("bos_token")), _token_text(cfg.get("eos_token")))
        if template is not None:
            text.template()  # a template that does not compile fails here, at load, not on every request
        return text

    def encode(self, text: str, special: bool = True) -> list[int]:
        """Token ids of ``text``; ``special``: with the tokenizer's own added tokens (BOS).

        Raises:
            ValueError: ``text`` is not valid Unicode (a lone surrogate, as JSON escapes allow).
        """
        return self.tokenizer.encode(valid_unicode("the text", text), add_special_tokens=special).ids

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids)

    def token_bytes(self, i: int) -> bytes:
        """The bytes token ``i`` stands for, a piece of a UTF-8 character included (what OpenAI's
        logprobs ``bytes`` hold): a byte-level BPE token (GPT-2's, Llama 3's) through its byte
        alphabet, a SentencePiece byte token ``<0xNN>`` as its byte, any other as its decoded text; a
        special token (end of sequence, say: not in the reply's text) none."""
        text = self.decode([i])
        if text == "":
            return b""
        piece = self.tokenizer.id_to_token(i) or ""
        if len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"):
            try:
                return bytes([int(piece[3:5], 16)])
            except ValueError:
                pass
        if type(self.tokenizer.decoder).__name__ == "ByteLevel" and all(c in _BYTE_OF for c in piece):
            return bytes(_BYTE_OF[c] for c in piece)
        return text.encode("utf-8")

    def chat_prompt(self, messages: list[dict]) -> str:
        """The prompt text of ``messages``, ending where the assistant's reply begins.

        Raises:
            ValueError: no chat template, malformed messages, or an error the template raises.
        """
        if self.chat_template is None:
            raise ValueError("this model has no chat template (tokenizer_config.json or chat_template.jinja)")
        if not isinstance(messages, list) or not messages:
            raise ValueError("messages must be a non-empty list")
        msgs = [{"role": _role(i, m), "content": _content(i, m)} for i, m in enumerate(messages)]
        import jinja2

        try:
            return self.template().render(
                messages=msgs, add_generation_prompt=True, bos_token=self.bos_token, eos_token=self.eos_token
            )
        except jinja2.exceptions.TemplateError as e:
            raise ValueError(f"the chat template refused the messages: {e}") from None
        except Exception as e:  # noqa: BLE001 - the template's own fault, on these messages
            raise ValueError(f"the chat template failed on these messages: {type(e).__name__}: {e}") from None

    def template(self):
        """The compiled chat template (Jinja2, sandboxed, as ``transformers`` renders it).

        Raises:
            ValueError: no template, or one that does not compile.
        """
        if self._template is None:
            if self.chat_template is None:
                raise ValueError("this model has no chat template (tokenizer_config.json or chat_template.jinja)")
            import jinja2
            from jinja2.sandbox import ImmutableSandboxedEnvironment

            def raise_exception(msg):
                raise jinja2.exceptions.TemplateError(msg)

            env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
            env.globals["raise_exception"] = raise_exception
            try:
                self._template = env.from_string(self.chat_template)
            except jinja2.exceptions.TemplateSyntaxError as e:
                raise ValueError(f"the chat template does not compile: line {e.lineno}: {e.message}") from None
        return self._template


class TextStream:
    """One request's text as its tokens arrive, cut at the first of ``stops``.

    :meth:`push` returns the text that is now final; :attr:`stopped` turns True when a stop string
    appears (the text ends before it, the stop string itself not included; :attr:`used` then counts
    the tokens up to the one that completed it); :meth:`flush` returns what was held back once no
    more tokens come.
    """

    def __init__(self, text: LlmText, stops: list[str] | tuple[str, ...] = ()):
        self.text, self.stops = text, [s for s in stops if s]
        self.tokens: list[int] = []
        self._prefix = self._read = 0  # the decode window: tokens[prefix:read] are already text
        self._pending = ""  # final text not yet handed out (it may begin a stop string)
        self._emitted = 0  # characters handed out so far
        self.stopped = False
        #: tokens that count: all of them, or after a stop, those up to the one that completed it
        self.used = 0
        #: tokens no stop string can cut any more (their text all handed out, or the stream ended):
        #: what a streamed reply may send the ids and logprobs of
        self.settled = 0

    def _new_text(self, final: bool = False) -> str:
        prev = self.text.decode(self.tokens[self._prefix : self._read])
        full = self.text.decode(self.tokens[self._prefix :])
        if not final and (len(full) <= len(prev) or full.endswith("\ufffd")):  # an incomplete character
            return ""
        self._prefix, self._read = self._read, len(self.tokens)
        return full[len(prev) :]

    def _cut(self, final: bool) -> str:
        hits = [(i, i + len(s)) for i, s in ((self._pending.find(s), s) for s in self.stops) if i >= 0]
        if hits:
            self.stopped = True
            start, end = min(hits)
            self._used_through(self._emitted + end)
            out, self._pending = self._pending[:start], ""
            self._emitted += len(out)
            return out
        hold = 0  # the longest tail that could be the start of a stop string (none at the end)
        if not final:
            for s in self.stops:
                for k in range(min(len(s) - 1, len(self._pending)), hold, -1):
                    if self._pending.endswith(s[:k]):
                        hold = k
                        break
        cut = len(self._pending) - hold
        out, self._pending = self._pending[:cut], self._pending[cut:]
        self._emitted += len(out)
        return out

    def _used_through(self, chars: int) -> None:
        """:attr:`used`: the fewest tokens whose text has the first ``chars`` characters (the stop's
        end) of the whole text (a character split over tokens counts once its last piece is in)."""
        want = self.text.decode(self.tokens)[:chars]
        lo, hi = 1, len(self.tokens)  # (bisected: the stop may lie in text held back over many pushes)
        while lo < hi:
            mid = (lo + hi) // 2
            if self.text.decode(self.tokens[:mid])[:chars] == want:
                hi = mid
            else:
                lo = mid + 1
        self.used = hi

    def push(self, tokens: list[int]) -> str:
        """New token ids in; the text now final out ("" while held back, and after a stop)."""
        if self.stopped:
            return ""
        self.tokens += tokens
        self.used = len(self.tokens)
        self._pending += self._new_text()
        out = self._cut(final=False)
        if self.stopped or not self.stops or (not self._pending and self._read == len(self.tokens)):
            self.settled = self.used
        return out

    def flush(self) -> str:
        """The rest, once the request has ended ("" after a stop)."""
        if self.stopped:
            return ""
        if self._read < len(self.tokens):
            self._pending += self._new_text(final=True)
        out = self._cut(final=True)
        self.settled = self.used
        return out


def _byte_alphabet() -> dict[str, int]:
    """Byte-level BPE's alphabet (GPT-2's ``bytes_to_unicode``), reversed: character -> the byte it stands for."""
    keep = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("\u00a1"), ord("\u00ac") + 1),
        *range(ord("\u00ae"), ord("\u00ff") + 1),
    ]
    chars, n = {}, 0
    for b in range(256):
        if b in keep:
            chars[chr(b)] = b
        else:
            chars[chr(256 + n)] = b
            n += 1
    return chars


_BYTE_OF = _byte_alphabet()
