"""Request checks for `jakiro serve`: an ASGI wrapper of transformers' OpenAI-compatible app that answers the chat
completions transformers would fail on mid-generate with an OpenAI-style 400 up front, and makes `temperature` > 0
sample (see `serve.py` for the route and what transformers itself does)."""

from __future__ import annotations

import json
import logging
import math

logger = logging.getLogger("transformers_jakiro.serve")  # the server's log lines, one logger


def _openai_error(message: str, param: str | None, status: int = 400) -> tuple[int, bytes]:
    body = {"error": {"message": message, "type": "invalid_request_error", "param": param, "code": None}}
    return status, json.dumps(body).encode()


def non_finite_field(value, path: str = "") -> tuple[str, float] | None:
    """The first field of a parsed JSON body that holds NaN, Infinity or -Infinity (Python's json reads them as
    floats; transformers would pass them on into generation), as (its path, the value); None when every number is
    finite. Paths name fields as a client wrote them: `temperature`, `logit_bias.50256`, `messages[0].weight`."""
    if isinstance(value, float) and not math.isfinite(value):
        return path or "(the body)", value
    if isinstance(value, dict):
        items = ((f"{path}.{key}" if path else str(key), item) for key, item in value.items())
    elif isinstance(value, list):
        items = ((f"{path}[{i}]", item) for i, item in enumerate(value))
    else:
        return None
    for where, item in items:
        found = non_finite_field(item, where)
        if found is not None:
            return found
    return None


def continuous_batching_applies_stop() -> bool:
    """Whether `stop` reaches the Jakiro rounds under continuous batching: transformers' server builds a request's
    arguments for the batching manager in `CBGenerateRunner._build_continuous_batching_kwargs` (5.25), which the
    model's process extends with the stop strings (`serve_batching.pass_stop_strings`)."""
    try:
        from transformers.cli.serving.utils import CBGenerateRunner
    except ImportError:
        return False
    return hasattr(CBGenerateRunner, "_build_continuous_batching_kwargs")


class RequestChecks:
    """An ASGI wrapper of transformers' app: answers the chat completion requests that transformers would fail on
    in the middle of a generate (a 500, or an error event inside a 200 stream) with a 400 up front; passes every
    other request through untouched."""

    PATHS = ("/v1/chat/completions",)

    def __init__(self, app, tokenizer, context: int | None, generation_config=None, continuous_batching: bool = False):
        self.app = app
        self.continuous_batching = continuous_batching
        self.tokenizer = tokenizer
        self.context = context
        self.generation_config = generation_config  # the served model's, for `sampling_config`

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope.get("method") != "POST" or scope.get("path") not in self.PATHS:
            return await self.app(scope, receive, send)
        chunks, more = [], True
        while more:
            message = await receive()
            if message["type"] != "http.request":  # the client went away before sending its body
                return await self.app(scope, _replay([message]), send)
            chunks.append(message.get("body", b""))
            more = message.get("more_body", False)
        raw = b"".join(chunks)
        problem = self.check(raw)
        if isinstance(problem, bytes):  # the request, rewritten (`sampling_config`)
            raw, problem = problem, None
        if problem is not None:
            status, body = problem
            logger.warning("jakiro: rejected a request (%d): %s", status, json.loads(body)["error"]["message"])
            await send({"type": "http.response.start", "status": status,
                        "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]})
            await send({"type": "http.response.body", "body": body})
            return
        return await self.app(scope, _replay([{"type": "http.request", "body": raw, "more_body": False}], receive),
                              send)

    def check(self, raw: bytes):
        try:
            body = json.loads(raw)
        except ValueError:
            return None  # malformed JSON: transformers' own 422
        if not isinstance(body, dict):
            return None
        found = non_finite_field(body)
        if found is not None:
            where, value = found
            return _openai_error(f"`{where}` must be a finite number, got {value!r} (JSON NaN or Infinity).",
                                 where.split(".")[0].split("[")[0])
        for param in ("max_tokens", "max_completion_tokens"):
            value = body.get(param)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                return _openai_error(f"`{param}` must be a positive integer, got {value!r}.", param)
        temperature = body.get("temperature")
        if temperature is not None and (isinstance(temperature, bool) or not isinstance(temperature, (int, float))
                                        or temperature < 0):
            return _openai_error(f"`temperature` must be a number >= 0, got {temperature!r}.", "temperature")
        top_p = body.get("top_p")
        if top_p is not None and (isinstance(top_p, bool) or not isinstance(top_p, (int, float))
                                  or not 0 < top_p <= 1):
            return _openai_error(f"`top_p` must be a number in (0, 1], got {top_p!r}.", "top_p")
        if self.continuous_batching and body.get("stop") and not continuous_batching_applies_stop():
            return _openai_error(
                "`stop` is not applied under continuous batching with this transformers version (its continuous "
                "batching drops it and would answer past the stop string): leave `stop` out, or run jakiro serve "
                "--no-continuous-batching.", "stop")
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages or not all(
                isinstance(m, dict) and isinstance(m.get("role"), str) for m in messages):
            return _openai_error("`messages` must be a non-empty list of messages, each an object with a `role`.",
                                 "messages")
        if self.context is None or self.tokenizer is None:
            return None
        try:
            prompt = len(self._prompt_ids(messages, body.get("tools")))
        except Exception:  # noqa: BLE001 -- let transformers report what it makes of such messages
            return None
        if prompt >= self.context:
            return _openai_error(
                f"The prompt is {prompt} tokens long, and this model's context is {self.context} tokens: shorten the "
                "messages.", "messages")
        wanted = body.get("max_completion_tokens") or body.get("max_tokens")
        if wanted is not None and prompt + wanted > self.context:
            return _openai_error(
                f"This model's context is {self.context} tokens; the prompt is {prompt} tokens and max_tokens asks "
                f"for {wanted} more ({prompt + wanted}). Lower max_tokens or shorten the messages.", "max_tokens")
        sampled = self.sampling_config(body)
        if sampled is not None:
            return json.dumps({**body, "generation_config": sampled}).encode()
        return None

    def sampling_config(self, body: dict) -> str | None:
        """OpenAI's meaning of `temperature` > 0 (or `top_p` < 1): sample. transformers' server only sets the request's
        temperature and top_p on the model's generation config, so a model whose config does not sample (SmolLM2's,
        Qwen2.5's GGUF-derived ones) would answer greedily; such a request gets the model's generation config with
        `do_sample=True` as its `generation_config` (and the server's usual 1024-token default), on which the server
        then sets temperature, top_p, max_tokens and stop as usual. Greedy requests are left untouched."""
        config = self.generation_config
        if config is None or body.get("generation_config") is not None or getattr(config, "do_sample", False):
            return None
        temperature, top_p = body.get("temperature"), body.get("top_p")
        if not ((temperature is not None and temperature > 0) or (top_p is not None and top_p < 1)):
            return None
        values = {k: v for k, v in config.to_diff_dict().items() if k not in ("transformers_version", "_from_model_config")}
        values["do_sample"] = True
        if values.get("max_new_tokens") is None or values["max_new_tokens"] < 1024:
            values["max_new_tokens"] = 1024  # what the server gives a request without max_tokens
        return json.dumps(values)

    def _prompt_ids(self, messages, tools):
        flat = []
        for message in messages:
            content = message.get("content") or ""
            if isinstance(content, list):
                content = " ".join(part.get("text", "") for part in content if isinstance(part, dict))
            flat.append({**message, "content": content})
        ids = self.tokenizer.apply_chat_template(flat, tools=tools, add_generation_prompt=True, tokenize=True)
        if isinstance(ids, dict) or hasattr(ids, "keys"):
            ids = ids["input_ids"]
        return ids


def _replay(messages, receive=None):
    queue = list(messages)

    async def replayed():
        if queue:
            return queue.pop(0)
        if receive is not None:
            return await receive()  # after the body: wait for the disconnect, as the server would
        return {"type": "http.disconnect"}

    return replayed


__all__ = ["RequestChecks", "continuous_batching_applies_stop"]
