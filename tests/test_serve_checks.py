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


def test_stop_strings_refused_under_continuous_batching_only_where_they_cannot_be_applied(monkeypatch):
    """Under continuous batching `stop` reaches the Jakiro rounds where transformers' server builds each request's
    batching arguments in the method the model's process extends; where it does not (another layout) a request with
    stop strings gets a 400 naming the field instead of an answer that runs past them. Without continuous batching,
    and with an empty `stop`, it passes."""
    from transformers_jakiro import serve_checks

    body = json.dumps({"model": "m", "messages": MESSAGES, "stop": ["\n\n"]}).encode()
    batching = RequestChecks(app=None, tokenizer=None, context=None, continuous_batching=True)
    assert (batching.check(body) is None) == serve_checks.continuous_batching_applies_stop()
    monkeypatch.setattr(serve_checks, "continuous_batching_applies_stop", lambda: False)
    status, text = batching.check(body)
    error = json.loads(text)["error"]
    assert status == 400 and error["param"] == "stop" and "--no-continuous-batching" in error["message"]
    assert RequestChecks(app=None, tokenizer=None, context=None).check(body) is None
    empty = json.dumps({"model": "m", "messages": MESSAGES, "stop": []}).encode()
    assert batching.check(empty) is None


@pytest.mark.skipif(not __import__("transformers_jakiro.serve_checks").serve_checks.continuous_batching_applies_stop(),
                    reason="this transformers' server builds continuous batching arguments otherwise")
def test_the_model_process_hands_stop_strings_to_the_jakiro_manager_only():
    """`serve_batching.pass_stop_strings` (run in the server's model process): transformers' continuous batching runner
    builds a request's arguments with its stop strings and the tokenizer for the Jakiro manager; for transformers'
    own manager (the rounds refused the model) a request with `stop` fails by name."""
    from transformers.cli.serving.utils import CBGenerateRunner

    from transformers_jakiro.continuous import JakiroContinuousBatchingManager
    from transformers_jakiro.serve_batching import pass_stop_strings

    pass_stop_strings()
    pass_stop_strings()  # once only
    assert CBGenerateRunner._build_continuous_batching_kwargs._jakiro
    assert not getattr(CBGenerateRunner._build_continuous_batching_kwargs.__wrapped__, "_jakiro", False)

    class Processor:
        supported_keys = {"temperature": float, "top_k": int, "top_p": float}

    def runner(manager_class):
        runner = object.__new__(CBGenerateRunner)
        runner.manager = object.__new__(manager_class)
        runner.manager.logit_processor = Processor()
        runner.processor = "the tokenizer"
        return runner

    request = dict(do_sample=False, temperature=None, max_new_tokens=8, eos_token_id=2, stop_strings=["."])
    kwargs = CBGenerateRunner._build_continuous_batching_kwargs(runner(JakiroContinuousBatchingManager), request)
    assert kwargs["stop_strings"] == ["."] and kwargs["tokenizer"] == "the tokenizer" and kwargs["max_new_tokens"] == 8
    plain = runner(type("PlainManager", (), {}))
    with pytest.raises(ValueError, match="`stop` is not applied by transformers. own continuous batching"):
        CBGenerateRunner._build_continuous_batching_kwargs(plain, request)
    unstopped = {**request, "stop_strings": None}
    assert "stop_strings" not in CBGenerateRunner._build_continuous_batching_kwargs(plain, unstopped)


