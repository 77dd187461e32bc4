"""`jakiro serve --continuous-batching`: transformers' own server and continuous batching, each request verifying its
own Jakiro tree, called with the real `openai` client by concurrent clients (SmolLM2-135M-Instruct, float32, the
shipped head). Every answer equals plain greedy `generate` of that request alone, stop strings included; streaming
and a client that goes away mid-stream leave the other requests exact. Before transformers 5.25 the flag is refused
by name."""

import concurrent.futures
import subprocess
import sys
from pathlib import Path

import openai
import pytest

from transformers_jakiro.continuous_support import page_allocators_available
from transformers_jakiro.serve import ServerProcess

HEAD = Path(__file__).resolve().parents[1] / "heads" / "jakiro-smollm2-135m-instruct"
TARGET = "smollm2-135m-instruct"
MAX_TOKENS = 32
PROMPTS = [
    "What is the capital of France? Answer in one sentence.",
    "Write a Python function that returns the square of a number.",
    "Name three colors of the rainbow.",
    "Write a haiku about rain.",
    "Explain what a hash map is in two sentences.",
    "List the first five prime numbers.",
]
SUPPORTED = page_allocators_available()

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def server(smollm2):  # smollm2: skips where the target is not installed, and writes its plain copy once
    if not SUPPORTED:
        pytest.skip("transformers < 5.25: refused (test_flag_refused_before_5_25)")
    process = ServerProcess(TARGET, str(HEAD), threads=2, extra=[
        "--continuous-batching", "--cb-num-blocks", "128", "--cb-max-batch-tokens", "256", "--cb-block-size", "32"])
    try:
        yield process.wait_ready()
    finally:
        process.stop()


def _client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="none", timeout=300, max_retries=0)


def _ask(server, prompt: str, **kwargs) -> str:
    return _answer(server, prompt, **kwargs).choices[0].message.content


def _answer(server, prompt: str, **kwargs):
    client = _client(server)
    model = client.models.list().data[0].id
    return client.chat.completions.create(model=model, messages=[{"role": "user", "content": prompt}],
                                          max_tokens=MAX_TOKENS, temperature=0, **kwargs)


def _alone(smollm2, prompt: str, stop: list[str] | None = None) -> str:
    model, tokenizer = smollm2
    ids = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                        return_tensors="pt", return_dict=True)["input_ids"]
    stops = dict(stop_strings=stop, tokenizer=tokenizer) if stop else {}
    out = model.generate(ids, max_new_tokens=MAX_TOKENS, do_sample=False, **stops)
    return tokenizer.decode(out[0, ids.shape[1] :], skip_special_tokens=True)


def test_concurrent_answers_equal_generate_alone(server, smollm2):
    with concurrent.futures.ThreadPoolExecutor(len(PROMPTS)) as pool:
        answers = list(pool.map(lambda p: _ask(server, p), PROMPTS))
    assert answers == [_alone(smollm2, p) for p in PROMPTS]
    log = server.log()
    assert "continuous batching with the Jakiro draft" in log
    assert "jakiro request" in log and "tree" in log  # per-request lines, and trees were verified


def test_streaming_and_a_client_that_goes_away(server, smollm2):
    """One client reads two chunks of a stream and closes it while others decode: theirs stay exact, and the server
    answers afterwards."""
    client = _client(server)
    model = client.models.list().data[0].id

    def leave_early():
        stream = client.chat.completions.create(model=model, messages=[{"role": "user", "content": PROMPTS[0]}],
                                                max_tokens=200, temperature=0, stream=True)
        for i, _ in enumerate(stream):
            if i == 2:
                break
        stream.close()

    def streamed(prompt):
        stream = client.chat.completions.create(model=model, messages=[{"role": "user", "content": prompt}],
                                                max_tokens=MAX_TOKENS, temperature=0, stream=True)
        return "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices)

    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        gone = pool.submit(leave_early)
        answers = list(pool.map(streamed, PROMPTS[1:4]))
        gone.result()
    assert answers == [_alone(smollm2, p) for p in PROMPTS[1:4]]
    assert _ask(server, PROMPTS[4]) == _alone(smollm2, PROMPTS[4])


def test_stop_strings_end_answers_where_generate_alone_ends_them(server, smollm2):
    """`stop` under continuous batching: four concurrent requests, each with a word from the middle of its answer as
    its stop string (two streamed): each answer ends after the token that completes it, as greedy
    `generate(stop_strings=...)` of that request alone ends, with finish_reason "stop"; one without `stop` beside them
    runs on."""
    full = {p: _alone(smollm2, p) for p in PROMPTS[:5]}
    stops = {p: [text.split()[len(text.split()) // 2]] for p, text in full.items()}
    client = _client(server)
    model = client.models.list().data[0].id

    def streamed(prompt):
        stream = client.chat.completions.create(model=model, messages=[{"role": "user", "content": prompt}],
                                                max_tokens=MAX_TOKENS, temperature=0, stream=True, stop=stops[prompt])
        chunks = [chunk.choices[0] for chunk in stream if chunk.choices]
        return "".join(c.delta.content or "" for c in chunks), chunks[-1].finish_reason

    def whole(prompt):
        answer = _answer(server, prompt, stop=stops[prompt])
        return answer.choices[0].message.content, answer.choices[0].finish_reason

    with concurrent.futures.ThreadPoolExecutor(5) as pool:
        jobs = [pool.submit(whole, PROMPTS[0]), pool.submit(streamed, PROMPTS[1]), pool.submit(whole, PROMPTS[2]),
                pool.submit(streamed, PROMPTS[3]), pool.submit(_ask, server, PROMPTS[4])]
        answers = [job.result() for job in jobs]
    for prompt, (text, finish) in zip(PROMPTS[:4], answers):
        assert text == _alone(smollm2, prompt, stops[prompt]), prompt
        assert stops[prompt][0] in text and len(text) < len(full[prompt]) and finish == "stop"
    assert answers[4] == full[PROMPTS[4]]


def _print_command(*flags: str, draft: str = str(HEAD)) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", "transformers_jakiro.cli", "serve", "--target", TARGET, "--draft", draft,
               *flags, "--print-command"]
    return subprocess.run(command, capture_output=True, text=True, timeout=300)


def test_flag_refused_before_5_25_and_passed_through_after(smollm2):
    done = _print_command("--continuous-batching")
    if SUPPORTED:
        assert done.returncode == 0, done.stderr
        assert "--continuous-batching" in done.stdout and "--cb-num-blocks 512" in done.stdout
    else:
        assert done.returncode != 0
        assert "needs transformers >= 5.25" in done.stderr


def test_on_by_default_with_a_draft_where_supported(smollm2):
    """Without the flag: continuous batching with a draft from 5.25 on (the KV memory sized explicitly), one request at
    a time before, with a line saying why; `--no-continuous-batching` and `--draft none` serve one at a time."""
    default = _print_command()
    assert default.returncode == 0, default.stderr
    if SUPPORTED:
        assert "--continuous-batching --dtype" in default.stdout and "--cb-num-blocks 512" in default.stdout
    else:
        assert "--continuous-batching" not in default.stdout
        assert "one request at a time" in default.stderr and "needs transformers >= 5.25" in default.stderr
    for done in (_print_command("--no-continuous-batching"), _print_command(draft="none")):
        assert done.returncode == 0, done.stderr
        assert "--continuous-batching" not in done.stdout and "one request at a time" not in done.stderr


def test_prepared_config_carries_the_settings(smollm2):
    import json

    from transformers_jakiro.serve import prepare

    prepared = prepare(TARGET, str(HEAD), continuous_batching=True)
    config = json.loads((prepared.snapshot / "config.json").read_text())
    assert config["jakiro_continuous_batching"]["continuous_batching"] is True


def test_concurrency_benchmark_report_and_memory():
    """`benchmarks/serve_concurrency.py`: ratios against plain continuous batching at the same client count, and the
    resident memory of a process tree (this process: at least its own)."""
    import os

    from benchmark_scripts import load_script

    script = load_script("serve_concurrency.py", "serve_concurrency")
    run = lambda clients, rate: {"clients": clients, "tokens_per_s": rate, "p50_s": 1.0, "p90_s": 2.0,  # noqa: E731
                                 "identical": "4/4", "errors": []}
    results = {"plain-cb": [run(1, 10.0), run(8, 40.0)], "jakiro-cb": [run(1, 30.0), run(8, 36.0)]}
    meta = {"args": {"target": "t", "dtype": "float32", "suite": "mt_bench", "requests": 4, "max_tokens": 8},
            "date": "d", "commit": "c", "command": "x", "reference": "plain-cb"}
    table = script.report(meta, results, [1, 8])
    assert "| jakiro-cb | 1 | 30.0 | 3.00x |" in table and "| jakiro-cb | 8 | 36.0 | 0.90x |" in table
    assert script.tree_rss_mib(os.getpid()) > 10


def test_interleaved_bursts_alternate_and_pair_up(monkeypatch):
    """`serve_concurrency.py --interleave`: each client count's bursts run server after server, the order reversed
    every other repeat; a server's bursts merge into one run, and each burst is paired with the baseline's burst of
    the same repeat."""
    from benchmark_scripts import load_script

    script = load_script("serve_concurrency.py", "serve_concurrency")
    order, rates = [], {"plain-cb": [10.0, 20.0], "jakiro-cb": [15.0, 20.0]}

    def fake_run(server, requests, clients, max_tokens):
        order.append((server, clients))
        rate = rates[server][sum(name == server for name, c in order if c == clients) - 1]
        rows = [{"prompt": p, "text": "t", "tokens": 10, "latency_s": 10 / rate} for p in requests]
        return {"clients": clients, "wall_s": 10 * len(rows) / rate, "tokens": 10 * len(rows),
                "tokens_per_s": rate, "errors": [], "rows": rows}

    monkeypatch.setattr(script, "run_clients", fake_run)
    servers = {"plain-cb": "plain-cb", "jakiro-cb": "jakiro-cb"}
    results = script.interleaved(servers, ["a", "b"], [1, 8], 2, 16)
    assert order == [("plain-cb", 1), ("jakiro-cb", 1), ("jakiro-cb", 1), ("plain-cb", 1),
                     ("plain-cb", 8), ("jakiro-cb", 8), ("jakiro-cb", 8), ("plain-cb", 8)]
    merged = results["jakiro-cb"][0]
    assert merged["tokens"] == 40 and merged["bursts_tokens_per_s"] == [15.0, 20.0]
    assert abs(merged["tokens_per_s"] - 40 / (20 / 15 + 1)) < 1e-9  # all tokens over all bursts' wall time
    for runs in results.values():
        for run in runs:
            run["identical"] = "4/4"
    meta = {"args": {"target": "t", "dtype": "float32", "suite": "mt_bench", "requests": 2, "max_tokens": 16,
                     "interleave": 2}, "date": "d", "commit": "c", "command": "x", "reference": "plain-cb"}
    table = script.report(meta, results, [1, 8])
    assert "| 1.22x (1.00-1.50, 2 pairs) |" in table  # sqrt(1.5 x 1.0)
