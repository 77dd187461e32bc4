"""`jakiro serve`'s request checks (`serve_checks.RequestChecks.check`) on request bodies, without a server: what
gets a 400 up front, naming the field."""

import json

import pytest

from transformers_jakiro.serve_checks import RequestChecks, non_finite_field

MESSAGES = [{"role": "user", "content": "Hi"}]


def _check(body) -> tuple[int, dict] | None:
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()  # json.dumps writes NaN / Infinity
    problem = RequestChecks(app=None, tokenizer=None, context=None).check(raw)
    if problem is None or isinstance(problem, bytes):
        return None
    status, text = problem
    return status, json.loads(text)["error"]


@pytest.mark.parametrize("value", [float("nan"), float("inf"), float("-inf")])
@pytest.mark.parametrize("field, body", [
    ("temperature", lambda v: {"temperature": v}),
    ("top_p", lambda v: {"top_p": v}),
    ("frequency_penalty", lambda v: {"frequency_penalty": v}),
    ("presence_penalty", lambda v: {"presence_penalty": v}),
    ("logit_bias.50", lambda v: {"logit_bias": {"50": v}}),
    ("messages[0].weight", lambda v: {"messages": [{"role": "user", "content": "Hi", "weight": v}]}),
    ("tools[0].function.parameters.default", lambda v: {"tools": [
        {"type": "function", "function": {"name": "f", "parameters": {"default": v}}}]}),
])
def test_non_finite_numbers_anywhere_get_a_400_naming_the_field(field, body, value):
    status, error = _check({"model": "m", "messages": MESSAGES, **body(value)})
    assert status == 400 and f"`{field}` must be a finite number" in error["message"]
    assert error["param"] == field.split(".")[0].split("[")[0]


def test_finite_requests_pass():
    assert _check({"model": "m", "messages": MESSAGES, "temperature": 0.7, "top_p": 0.9, "logit_bias": {"5": -1.5},
                   "max_tokens": 8}) is None
    assert non_finite_field({"a": [1, 2.5, {"b": "NaN"}], "c": None, "d": True}) is None  # the string "NaN" is text
    assert non_finite_field([0.0, [float("nan")]]) == ("[1][0]", pytest.approx(float("nan"), nan_ok=True))


def test_stop_strings_refused_under_continuous_batching_only():
    """transformers' continuous batching drops `stop`; under it a request with stop strings gets a 400 naming the
    field instead of an answer that runs past them. Without continuous batching, and with an empty `stop`, it passes."""
    body = json.dumps({"model": "m", "messages": MESSAGES, "stop": ["\n\n"]}).encode()
    status, text = RequestChecks(app=None, tokenizer=None, context=None, continuous_batching=True).check(body)
    error = json.loads(text)["error"]
    assert status == 400 and error["param"] == "stop" and "--continuous-batching" in error["message"]
    assert RequestChecks(app=None, tokenizer=None, context=None).check(body) is None
    empty = json.dumps({"model": "m", "messages": MESSAGES, "stop": []}).encode()
    assert RequestChecks(app=None, tokenizer=None, context=None, continuous_batching=True).check(empty) is None
