"""The OpenAI API's responses: a parsed request (Job) and how its engine outputs become choices,
streamed chunks, logprobs (an echoed prompt's too) and usage, in OpenAI's shapes (with vLLM's and
kvstore's extensions: token_ids, prompt_token_ids, usage.kvstore)."""

from __future__ import annotations

import dataclasses
import itertools
from dataclasses import dataclass

from engine.request import RequestOutput
from engine.sampler import SamplingParams
from kvstore.placement.index import CACHE_TIERS

LOGPROB_FLOOR = -9999.0     # the least logprob answered (vLLM's), so that -inf stays JSON


@dataclass
class Job:
    """One API request, parsed: the engine requests to run and how to answer."""

    prompts: list[str | list[int]]
    params: SamplingParams
    n: int
    stream: bool
    include_usage: bool
    return_token_ids: bool
    tenant: str
    priority: int
    echo: list[str] | None = None   # per prompt: the text a completion choice starts with

    def requests(self) -> list[tuple[str | list[int], SamplingParams]]:
        """(prompt, params) per choice: choice p * n + j is sample j of prompt p."""
        def sample(j: int) -> SamplingParams:
            seed = self.params.seed
            return self.params if j == 0 or seed is None else dataclasses.replace(self.params, seed=seed + j)
        return [(prompt, sample(j)) for prompt in self.prompts for j in range(self.n)]

    def echoed(self, index: int) -> str:
        return self.echo[index // self.n] if self.echo else ""


def streamable(text: str, stops: list[str]) -> str:
    """The part of a running request's text that cannot change any more: without a trailing
    partial character (decoded as U+FFFD) or the start of a stop string."""
    end = len(text.rstrip("\ufffd"))
    hold = max((k for s in stops for k in range(1, len(s)) if text[:end].endswith(s[:k])), default=0)
    return text[:end - hold]


def completion_logprobs(tok, entries: list[dict | None], offset: int, token_ids: list[int] | None = None) -> dict:
    """OpenAI's completions logprobs; text_offset counts from `offset` in the choice's text. An entry
    None (an echoed prompt's first token, whose id is token_ids[i]) has no logprob, as in vLLM; a
    logprob of -inf (a prompt token the tokenizer cannot produce) is given as -9999, vLLM's floor."""
    ids = [e["token_id"] if e is not None else token_ids[i] for i, e in enumerate(entries)]
    tokens = [tok.decode([t]) for t in ids]
    offsets = list(itertools.accumulate((len(t) for t in tokens[:-1]), initial=offset))[:len(tokens)]
    logprobs = [None if e is None else max(e["logprob"], LOGPROB_FLOOR) for e in entries]
    top = [None if e is None else {**{tok.decode([t]): lp for t, lp in e.get("top", [])}, token: lp}
           for e, token, lp in zip(entries, tokens, logprobs)]
    return {"tokens": tokens, "token_logprobs": logprobs, "top_logprobs": top, "text_offset": offsets}


def chat_logprobs(tok, entries: list[dict]) -> dict:
    def item(token_id: int, logprob: float) -> dict:
        token = tok.decode([token_id])
        return {"token": token, "logprob": logprob, "bytes": list(token.encode())}
    return {"content": [{**item(e["token_id"], e["logprob"]),
                         "top_logprobs": [item(t, lp) for t, lp in e.get("top", [])]} for e in entries]}


def usage(outs: list[RequestOutput], n: int) -> dict:
    firsts = outs[::n]          # one per prompt
    prompt = sum(len(o.prompt_token_ids) for o in firsts)
    completion = sum(len(o.token_ids) for o in outs)
    by_tier = {t: sum(o.cached_tokens.get(t, 0) for o in firsts) for t in CACHE_TIERS}
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": sum(by_tier.values())},
            # extension: where the cached prompt tokens came from, and how many were computed
            "kvstore": {"cached_tokens": by_tier, "prefill_tokens": sum(o.prefill_tokens for o in firsts)}}


class Choice:
    """One choice of a streamed response: what it has sent so far."""

    def __init__(self, index: int, job: Job, chat: bool, tok):
        self.index, self.job, self.chat, self.tok = index, job, chat, tok
        self.text = ""          # sent
        self.tokens = 0         # token ids (and logprobs) sent
        self.last: RequestOutput | None = None

    def chunk(self, out: RequestOutput) -> dict | None:
        """The chunk choice for a new output, or None while there is nothing new to send."""
        first, self.last = self.last is None, out
        text = out.text if out.finish_reason else streamable(out.text, self.job.params.stop)
        delta = text[len(self.text):] if text.startswith(self.text) else ""
        if not (delta or out.finish_reason or first):
            return None
        choice: dict = {"index": self.index}
        if self.chat:
            choice["delta"] = {"role": "assistant", "content": delta} if first else {"content": delta} if delta else {}
        else:
            choice["text"] = self.job.echoed(self.index) + delta if first else delta
        entries = (out.logprobs or [])[self.tokens:]
        if out.logprobs is None:
            choice["logprobs"] = None
        elif self.chat:
            choice["logprobs"] = chat_logprobs(self.tok, entries)
        else:   # the first chunk starts with the echoed prompt's logprobs, if any
            echoed = (out.prompt_logprobs or []) if first else []
            offset = 0 if first else len(self.job.echoed(self.index)) + len(self.text)
            choice["logprobs"] = completion_logprobs(self.tok, echoed + entries, offset, out.prompt_token_ids)
        choice["finish_reason"] = out.finish_reason
        if self.job.return_token_ids:
            choice["token_ids"] = out.token_ids[self.tokens:]
            if first:
                choice["prompt_token_ids"] = out.prompt_token_ids
        self.text, self.tokens = self.text + delta, len(out.token_ids)
        return choice


def final_choice(index: int, out: RequestOutput, job: Job, chat: bool, tok) -> dict:
    choice: dict = {"index": index}
    if chat:
        choice["message"] = {"role": "assistant", "content": out.text}
        choice["logprobs"] = None if out.logprobs is None else chat_logprobs(tok, out.logprobs)
    else:
        choice["text"] = job.echoed(index) + out.text
        choice["logprobs"] = None if out.logprobs is None else completion_logprobs(
            tok, (out.prompt_logprobs or []) + out.logprobs, 0, out.prompt_token_ids)
    choice["finish_reason"] = out.finish_reason
    if job.return_token_ids:
        choice["token_ids"] = out.token_ids
        choice["prompt_token_ids"] = out.prompt_token_ids
    return choice
