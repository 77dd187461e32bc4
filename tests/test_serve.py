"""`jakiro serve`: transformers' OpenAI-compatible server with the Jakiro draft attached, called with the real
`openai` client on 127.0.0.1. Two servers for the whole module, started side by side, one request at a time:
SmolLM2-135M-Instruct in float32 with the shipped head (`--no-continuous-batching`; continuous batching, the default
from transformers 5.25, is tested in test_serve_continuous.py), and the same target with `--draft none`; short
answers, one torch thread each."""

import http.client
import json
import time
from pathlib import Path

import openai
import pytest

from transformers_jakiro.serve import ServerProcess

HEAD = Path(__file__).resolve().parents[1] / "heads" / "jakiro-smollm2-135m-instruct"
TARGET = "smollm2-135m-instruct"
MAX_TOKENS = 24
PROMPTS = [
    "What is the capital of France? Answer in one sentence.",
    "Write a Python function that returns the square of a number.",
]

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def servers(smollm2):  # smollm2: skips where the target is not installed, and writes its plain copy once
    jakiro = ServerProcess(TARGET, str(HEAD), threads=1, extra=["--no-continuous-batching"])
    plain = ServerProcess(TARGET, None, threads=1)
    try:
        jakiro.wait_ready()
        plain.wait_ready()
        yield jakiro, plain
    finally:
        jakiro.stop()
        plain.stop()


def _client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="none", timeout=120, max_retries=0)


def _model(server) -> str:
    return _client(server).models.list().data[0].id


def _chat(server, prompt, **kwargs):
    messages = [{"role": "user", "content": prompt}]
    return _client(server).chat.completions.create(model=_model(server), messages=messages, **kwargs)


def _stream(server, prompt, **kwargs):
    # OpenAI's rule, which transformers follows from 5.25 on: a stream ends with usage only when asked for
    chunks = list(_chat(server, prompt, stream=True, stream_options={"include_usage": True}, **kwargs))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    usage = next((c.usage for c in reversed(chunks) if c.usage is not None), None)
    finish = next((c.choices[0].finish_reason for c in reversed(chunks) if c.choices and c.choices[0].finish_reason), None)
    return text, usage, finish


def test_models_lists_each_servers_model(servers):
    jakiro, plain = servers
    assert [m.id for m in _client(jakiro).models.list().data] == ["jakiro/smollm2-135m-instruct"]
    assert [m.id for m in _client(plain).models.list().data] == ["plain/smollm2-135m-instruct"]


def test_streamed_equals_non_streamed_equals_plain(servers):
    jakiro, plain = servers
    for prompt in PROMPTS:
        answer = _chat(jakiro, prompt, max_tokens=MAX_TOKENS, temperature=0)
        streamed, usage, finish = _stream(jakiro, prompt, max_tokens=MAX_TOKENS, temperature=0)
        reference = _chat(plain, prompt, max_tokens=MAX_TOKENS, temperature=0)
        text = answer.choices[0].message.content
        assert text and streamed == text == reference.choices[0].message.content
        assert answer.usage.completion_tokens == reference.usage.completion_tokens <= MAX_TOKENS
        assert answer.usage.prompt_tokens == reference.usage.prompt_tokens > 0
        assert usage is not None and usage.completion_tokens == answer.usage.completion_tokens
        assert finish == answer.choices[0].finish_reason == reference.choices[0].finish_reason
    # Jakiro's statistics, one line per request, in the server log
    assert "jakiro request:" in jakiro.log() and "tau" in jakiro.log()


def test_stop_strings_end_the_answer_where_plain_does(servers):
    jakiro, plain = servers
    prompt = PROMPTS[1]
    full = _chat(plain, prompt, max_tokens=MAX_TOKENS, temperature=0).choices[0].message.content
    words = full.split()
    stop = words[len(words) // 2]  # a word from the middle of the answer
    answer = _chat(jakiro, prompt, max_tokens=MAX_TOKENS, temperature=0, stop=[stop])
    reference = _chat(plain, prompt, max_tokens=MAX_TOKENS, temperature=0, stop=[stop])
    streamed, _, _ = _stream(jakiro, prompt, max_tokens=MAX_TOKENS, temperature=0, stop=[stop])
    text = answer.choices[0].message.content
    assert text == reference.choices[0].message.content == streamed
    assert stop in text and len(text) < len(full)
    assert answer.choices[0].finish_reason == reference.choices[0].finish_reason == "stop"


def test_sampling_with_a_seed_repeats(servers):
    jakiro, _ = servers
    kwargs = dict(max_tokens=MAX_TOKENS, temperature=0.9, top_p=0.95, seed=1234)
    first = _chat(jakiro, "Tell me about cats.", **kwargs).choices[0].message.content
    second = _chat(jakiro, "Tell me about cats.", **kwargs).choices[0].message.content
    greedy = _chat(jakiro, "Tell me about cats.", max_tokens=MAX_TOKENS, temperature=0).choices[0].message.content
    assert first and first == second
    others = {_chat(jakiro, "Tell me about cats.", **{**kwargs, "seed": seed}).choices[0].message.content
              for seed in (1, 2)}
    assert others | {first} != {greedy}  # temperature > 0 does sample


class _Response:
    def __init__(self, status_code, text):
        self.status_code, self.text = status_code, text

    def json(self):
        return json.loads(self.text)


def _connection(server) -> http.client.HTTPConnection:
    return http.client.HTTPConnection("127.0.0.1", server.port, timeout=60)


def _post(server, body, raw=None):
    content = raw if raw is not None else json.dumps(body).encode()
    connection = _connection(server)
    try:
        connection.request("POST", "/v1/chat/completions", body=content, headers={"content-type": "application/json"})
        response = connection.getresponse()
        return _Response(response.status, response.read().decode())
    finally:
        connection.close()


def test_bad_requests_get_4xx_and_the_server_stays_up(servers):
    jakiro, _ = servers
    model = _model(jakiro)
    message = [{"role": "user", "content": "Hi"}]
    response = _post(jakiro, None, raw=b'{"model": "x", "messages": [')
    assert response.status_code == 422, response.text
    response = _post(jakiro, {"model": "no/such-model", "messages": message, "max_tokens": 4})
    assert response.status_code == 400 and "no/such-model" in response.text
    for stream in (False, True):
        response = _post(jakiro, {"model": model, "messages": message, "max_tokens": -3, "stream": stream})
        assert response.status_code == 400 and "max_tokens" in response.json()["error"]["message"]
    long_prompt = [{"role": "user", "content": "word " * 9000}]  # SmolLM2's context is 8192 tokens
    response = _post(jakiro, {"model": model, "messages": long_prompt, "max_tokens": 4})
    assert response.status_code == 400 and "context is 8192 tokens" in response.json()["error"]["message"]
    with pytest.raises(openai.BadRequestError, match="max_tokens"):
        _chat(jakiro, "Hi", max_tokens=-1)
    for field, value in [("temperature", "NaN"), ("temperature", "Infinity"), ("frequency_penalty", "-Infinity")]:
        raw = f'{{"model": "{model}", "messages": [{{"role": "user", "content": "Hi"}}], "{field}": {value}}}'
        response = _post(jakiro, None, raw=raw.encode())
        assert response.status_code == 400 and f"`{field}` must be a finite number" in response.text, response.text
    # still serving
    assert _chat(jakiro, PROMPTS[0], max_tokens=4, temperature=0).choices[0].message.content


def test_a_client_that_goes_away_cancels_its_generate(servers):
    jakiro, _ = servers
    body = {"model": _model(jakiro), "stream": True, "max_tokens": 400, "temperature": 0,
            "messages": [{"role": "user", "content": "Write a long story about a dragon."}]}
    connection = _connection(jakiro)
    try:
        connection.request("POST", "/v1/chat/completions", body=json.dumps(body).encode(),
                           headers={"content-type": "application/json"})
        response = connection.getresponse()
        assert response.status == 200
        for _ in range(50):  # read up to the first token, then hang up
            if b'"content"' in response.readline():
                break
    finally:
        connection.close()
    deadline = time.monotonic() + 60
    while "cancelled (the client went away)" not in jakiro.log() and time.monotonic() < deadline:
        time.sleep(0.2)
    assert "cancelled (the client went away)" in jakiro.log()
    assert _chat(jakiro, PROMPTS[0], max_tokens=4, temperature=0).choices[0].message.content


def test_the_server_shuts_down_cleanly(servers):
    for server in servers:
        assert server.stop() == 0
        assert "Application shutdown complete" in server.log()
