"""Tokenizers: bytes for presets, a Hugging Face `tokenizer.json` for model directories.

Both give the same small interface: encode, decode, bos/eos ids, vocab_size, apply_chat_template.
Text that is not valid Unicode (a lone surrogate, as a JSON "\\ud800" escape gives) is an
InvalidRequest, never a UnicodeEncodeError.
"""

from __future__ import annotations

import json
from datetime import datetime
from functools import cached_property
from pathlib import Path

from engine.sampler import InvalidRequest
from kvstore.errors import ConfigError
from kvstore.pages.shapes import PRESETS


def check_text(text: str, name: str = "text") -> str:
    """`text` itself; InvalidRequest naming `name` when it cannot be encoded as UTF-8 (a lone surrogate)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise InvalidRequest(f"{name} is not valid Unicode: a lone surrogate at character {exc.start}") from None
    return text


class ByteTokenizer:
    """For presets (random weights): ids 0..255 are UTF-8 bytes, then bos=256, eos=257, pad=258.

    The model's vocabulary may be larger than vocab_size (259); the engine masks the logits of
    ids at or beyond vocab_size so they are never sampled.

    Chat format: one "<|role|>\\ncontent\\n" block per message, then "<|assistant|>\\n" when a
    generation prompt is asked for.
    """

    bos_token_id, eos_token_id, pad_token_id = 256, 257, 258
    vocab_size = 259

    @property
    def eos_token_ids(self) -> list[int]:
        return [self.eos_token_id]

    def encode(self, text: str, add_bos: bool = True) -> list[int]:
        return [self.bos_token_id] * add_bos + list(check_text(text).encode("utf-8"))

    def decode(self, ids: list[int]) -> str:
        return bytes(i for i in ids if 0 <= i < 256).decode("utf-8", errors="replace")

    def token_strs(self, ids: list[int]) -> list[str]:
        """Each id's token as the vocabulary spells it (a byte as its character, specials by name)."""
        names = {self.bos_token_id: "<bos>", self.eos_token_id: "<eos>", self.pad_token_id: "<pad>"}
        return [names.get(i) or chr(i) for i in ids]

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        text = "".join(f"<|{m['role']}|>\n{m['content']}\n" for m in messages)
        return text + "<|assistant|>\n" * add_generation_prompt


class HFTokenizer:
    """A model directory's `tokenizer.json`, with ids and chat template as transformers reads them.

    encode() adds exactly what the tokenizer's post-processor adds (BOS for Llama), as
    `AutoTokenizer(dir)(text)["input_ids"]` does; pass add_bos=False for text rendered by the chat
    template, which already holds its special tokens.
    """

    def __init__(self, path: str | Path):
        from tokenizers import Tokenizer

        self.path = Path(path)
        file = self.path / "tokenizer.json"
        if not file.is_file():
            raise ConfigError("model", str(self.path), "the model directory lacks tokenizer.json")
        self._tok = Tokenizer.from_file(str(file))
        self.config = _read_json(self.path / "tokenizer_config.json")
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)
        self.bos_token_id = self._token_id(self.config.get("bos_token"))
        # eos: generation_config.json may list several (Llama 3: <|end_of_text|>, <|eot_id|>)
        own_eos = self._token_id(self.config.get("eos_token"))
        listed = []
        for name in ("generation_config.json", "config.json"):
            eos = _read_json(self.path / name).get("eos_token_id")
            listed += eos if isinstance(eos, list) else [] if eos is None else [eos]
        self.eos_token_ids = list(dict.fromkeys(([own_eos] if own_eos is not None else []) + listed))
        self.eos_token_id = self.eos_token_ids[0] if self.eos_token_ids else None

    def _token_id(self, token) -> int | None:
        if isinstance(token, dict):     # a serialised AddedToken
            token = token.get("content")
        return self._tok.token_to_id(token) if isinstance(token, str) else None

    def encode(self, text: str, add_bos: bool = True) -> list[int]:
        return self._tok.encode(check_text(text), add_special_tokens=add_bos).ids

    def decode(self, ids: list[int]) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=True)

    def token_strs(self, ids: list[int]) -> list[str]:
        """Each id's token as the vocabulary spells it (transformers' convert_ids_to_tokens)."""
        return [self._tok.id_to_token(i) or "" for i in ids]

    @cached_property
    def chat_template(self) -> str | None:
        """tokenizer_config.json's `chat_template` (the default one if it lists several), else
        chat_template.jinja (where transformers 5 saves it)."""
        template = self.config.get("chat_template")
        if isinstance(template, list):
            named = {t.get("name"): t.get("template") for t in template}
            template = named.get("default")
        jinja_file = self.path / "chat_template.jinja"
        if template is None and jinja_file.is_file():
            template = jinja_file.read_text()
        return template

    @cached_property
    def _compiled_template(self):
        """The chat template compiled once, in the environment transformers renders it in."""
        import jinja2
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        def raise_exception(message):
            raise jinja2.exceptions.TemplateError(message)

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                            extensions=["jinja2.ext.loopcontrols"])
        env.filters["tojson"] = lambda x, ensure_ascii=False, indent=None, separators=None, sort_keys=False: \
            json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)
        env.globals.update(raise_exception=raise_exception, strftime_now=lambda f: datetime.now().strftime(f))
        try:
            return env.from_string(self.chat_template)
        except jinja2.exceptions.TemplateError as exc:
            raise InvalidRequest(f"chat template: {exc}") from None

    @cached_property
    def _special_tokens(self) -> dict[str, str]:
        special = {}
        for name in ("bos_token", "eos_token", "unk_token", "pad_token"):
            token = self.config.get(name)
            token = token.get("content") if isinstance(token, dict) else token
            if isinstance(token, str):
                special[name] = token
        return special

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        if not self.chat_template:
            raise InvalidRequest(f"model {self.path.name!r} has no chat template; use the completions API")
        import jinja2

        template = self._compiled_template
        try:
            return template.render(messages=messages, add_generation_prompt=add_generation_prompt,
                                   **self._special_tokens)
        except jinja2.exceptions.TemplateError as exc:
            raise InvalidRequest(f"chat template: {exc}") from None


def _read_json(file: Path) -> dict:
    if not file.is_file():
        return {}
    try:
        return json.loads(file.read_text())
    except ValueError as exc:
        raise ConfigError("model", str(file), f"is not valid JSON ({exc})") from None


def load_tokenizer(model: str) -> ByteTokenizer | HFTokenizer:
    """A preset name -> ByteTokenizer; a Hugging Face model directory -> HFTokenizer."""
    if model in PRESETS:
        return ByteTokenizer()
    if not Path(model).is_dir():
        raise ConfigError("model", model, f"must be a preset ({', '.join(PRESETS)}) or a model directory")
    return HFTokenizer(model)
