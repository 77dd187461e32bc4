"""`jakiro serve` against the same server without the draft (`--draft none`): what a client sees.

    .venv/bin/python benchmarks/serve.py --target smollm2-135m-instruct --dtype float32 --requests 20
    .venv/bin/python benchmarks/serve.py --target qwen2.5-coder-1.5b-instruct --dtype bfloat16 --suite humaneval
    .venv/bin/python benchmarks/serve.py ... --load 40 --clients 4      # add the load run on the Jakiro server

Both servers serve one request at a time (the Jakiro one with `--no-continuous-batching`; concurrent clients and
continuous batching are `serve_concurrency.py`'s). They run at once (`transformers_jakiro.serve.ServerProcess`,
127.0.0.1), each with every core, and the
requests alternate between them (plain first on even requests, Jakiro first on odd ones), one at a time, so a change
in the machine's load hits both alike; each server first answers one untimed request (its warm-up). Every request
is streamed with the `openai` client, greedy, `max_tokens` fixed:
time to first token (first content delta), latency (request to last chunk), tokens/s of the request (its usage's
completion tokens / latency), and whether the Jakiro text equals plain's.

The load run (`--load N --clients C`): N requests (the suite's prompts, streamed and not, alternately) from C
concurrent clients against the Jakiro server, after warm-up; every answer must equal the one the same server gave
the prompt alone, and the server's resident memory (VmRSS) is read after warm-up and after the run.

Results go to benchmarks/results/serve-<target>-<dtype>-<date>/: results.json (every request), README.md (summary
and the command that reruns it). Not a test: nothing here is timed in CI.
"""

import argparse
import datetime
import json
import statistics
import sys
import threading
import time
from pathlib import Path

import openai

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

from transformers_jakiro.serve import ServerProcess  # noqa: E402

SUITES = ROOT / "src" / "transformers_jakiro" / "bench" / "data"


def prompts(suite: str, count: int) -> list[str]:
    lines = (SUITES / f"{suite}.jsonl").read_text().splitlines()
    return [json.loads(line)["turns"][0] for line in lines if line.strip()][:count]


def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="none", timeout=1800, max_retries=0)


def model_id(server) -> str:
    return client(server).models.list().data[0].id


def streamed(server, model, prompt, max_tokens) -> dict:
    start = time.perf_counter()
    first = None
    parts, usage = [], None
    stream = client(server).chat.completions.create(
        model=model, messages=[{"role": "user", "content": prompt}], max_tokens=max_tokens, temperature=0, stream=True,
        stream_options={"include_usage": True})  # newer transformers send usage only when asked
    for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            if first is None:
                first = time.perf_counter() - start
            parts.append(chunk.choices[0].delta.content)
        if chunk.usage is not None:
            usage = chunk.usage
    latency = time.perf_counter() - start
    tokens = usage.completion_tokens if usage else 0
    return {"text": "".join(parts), "tokens": tokens, "ttft_s": first, "latency_s": latency,
            "tokens_per_s": tokens / latency if latency else 0.0}


def non_streamed(server, model, prompt, max_tokens) -> str:
    answer = client(server).chat.completions.create(
        model=model, messages=[{"role": "user", "content": prompt}], max_tokens=max_tokens, temperature=0)
    return answer.choices[0].message.content


def percentile(values, q):
    values = sorted(values)
    if not values:
        return float("nan")
    k = (len(values) - 1) * q
    lo, hi = int(k), min(int(k) + 1, len(values) - 1)
    return values[lo] + (values[hi] - values[lo]) * (k - lo)


def summary(rows) -> dict:
    tokens = sum(r["tokens"] for r in rows)
    seconds = sum(r["latency_s"] for r in rows)
    return {
        "requests": len(rows),
        "tokens": tokens,
        "tokens_per_s_overall": tokens / seconds if seconds else 0.0,
        "tokens_per_s_mean": statistics.mean(r["tokens_per_s"] for r in rows),
        "tokens_per_s_median": statistics.median(r["tokens_per_s"] for r in rows),
        "ttft_s_median": statistics.median(r["ttft_s"] for r in rows if r["ttft_s"] is not None),
        "latency_s_p50": percentile([r["latency_s"] for r in rows], 0.5),
        "latency_s_p95": percentile([r["latency_s"] for r in rows], 0.95),
    }


def rss_mib(server) -> float:
    for line in Path(f"/proc/{server.process.pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def load_run(server, model, suite_prompts, requests, clients, max_tokens) -> dict:
    """`requests` requests from `clients` threads; each answer checked against the prompt's answer alone."""
    reference = {p: non_streamed(server, model, p, max_tokens) for p in suite_prompts}  # warm-up too
    for p in suite_prompts[:2]:
        streamed(server, model, p, max_tokens)
    before = rss_mib(server)
    jobs = [(i, suite_prompts[i % len(suite_prompts)], i % 2 == 0) for i in range(requests)]
    results, lock = [], threading.Lock()

    def work(mine):
        for i, prompt, stream in mine:
            start = time.perf_counter()
            try:
                text = streamed(server, model, prompt, max_tokens)["text"] if stream else non_streamed(
                    server, model, prompt, max_tokens)
                error = None
            except Exception as exc:  # noqa: BLE001 -- recorded, counted as a wrong answer
                text, error = None, repr(exc)
            with lock:
                results.append({"request": i, "stream": stream, "correct": text == reference[prompt],
                                "error": error, "latency_s": time.perf_counter() - start})

    start = time.perf_counter()
    threads = [threading.Thread(target=work, args=(jobs[c::clients],)) for c in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - start
    after = rss_mib(server)
    return {"requests": requests, "clients": clients, "wall_s": wall,
            "correct": sum(r["correct"] for r in results), "errors": [r["error"] for r in results if r["error"]],
            "rss_mib_after_warmup": before, "rss_mib_after_load": after, "rss_mib_change": after - before,
            "server_alive": server.process.poll() is None, "rows": sorted(results, key=lambda r: r["request"])}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", default="smollm2-135m-instruct")
    parser.add_argument("--draft", default=None, help="head directory (default heads/jakiro-<target>)")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--suite", default="mt_bench", choices=["mt_bench", "humaneval", "alpaca", "grounded"])
    parser.add_argument("--requests", type=int, default=20)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--threads", type=int, default=None, help="torch threads per server (default: torch's)")
    parser.add_argument("--load", type=int, default=0, help="requests of the load run on the Jakiro server (0: none)")
    parser.add_argument("--clients", type=int, default=4)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()

    draft = args.draft or str(ROOT / "heads" / f"jakiro-{args.target}")
    date = datetime.date.today().isoformat()
    out = Path(args.out or ROOT / "benchmarks" / "results" / f"serve-{args.target}-{args.dtype}-{date}")
    out.mkdir(parents=True, exist_ok=True)
    suite_prompts = prompts(args.suite, args.requests)

    jakiro = ServerProcess(args.target, draft, dtype=args.dtype, threads=args.threads,  # one at a time, as plain
                           log_path=out / "server-jakiro.log", extra=["--no-continuous-batching"])
    plain = ServerProcess(args.target, None, dtype=args.dtype, threads=args.threads, log_path=out / "server-plain.log")
    rows = []
    try:
        jakiro.wait_ready(1800)
        plain.wait_ready(1800)
        models = {"jakiro": model_id(jakiro), "plain": model_id(plain)}
        servers = {"jakiro": jakiro, "plain": plain}
        # One untimed request each first: from transformers 5.25 the model's process warms up on its first request
        # (it ran at a third of the speed of later ones), which would weigh on whichever server warms up slower.
        for name in servers:
            streamed(servers[name], models[name], suite_prompts[0], 16)
        for i, prompt in enumerate(suite_prompts):
            pair = {}
            for name in (("plain", "jakiro") if i % 2 == 0 else ("jakiro", "plain")):
                pair[name] = streamed(servers[name], models[name], prompt, args.max_tokens)
            same = pair["jakiro"]["text"] == pair["plain"]["text"]
            for name, row in pair.items():
                rows.append({"request": i, "server": name, **row, "same_text": same})
            print(f"[{i + 1}/{len(suite_prompts)}] plain {pair['plain']['tokens_per_s']:.1f} tok/s, jakiro "
                  f"{pair['jakiro']['tokens_per_s']:.1f} tok/s, same text: {same}", flush=True)
        load = None
        if args.load:
            plain.stop()
            load = load_run(jakiro, models["jakiro"], suite_prompts[:8], args.load, args.clients, min(args.max_tokens, 64))
            print(f"load run: {load['correct']}/{load['requests']} correct in {load['wall_s']:.0f} s, RSS "
                  f"{load['rss_mib_after_warmup']:.0f} -> {load['rss_mib_after_load']:.0f} MiB", flush=True)
    finally:
        jakiro.stop()
        plain.stop()

    result = {
        "command": "python " + " ".join(sys.argv),
        "date": date,
        "target": args.target, "draft": draft, "dtype": args.dtype, "suite": args.suite,
        "max_tokens": args.max_tokens, "threads": args.threads,
        "plain": summary([r for r in rows if r["server"] == "plain"]),
        "jakiro": summary([r for r in rows if r["server"] == "jakiro"]),
        "identical_text": sum(r["same_text"] for r in rows if r["server"] == "jakiro"),
        "rows": rows,
        "load": load,
    }
    p, j = result["plain"], result["jakiro"]
    result["speedup_overall"] = j["tokens_per_s_overall"] / p["tokens_per_s_overall"]
    pairs = {}
    for r in rows:
        pairs.setdefault(r["request"], {})[r["server"]] = r["tokens_per_s"]
    result["speedup_median_per_request"] = statistics.median(v["jakiro"] / v["plain"] for v in pairs.values())
    (out / "results.json").write_text(json.dumps(result, indent=2) + "\n")
    (out / "README.md").write_text(report(result))
    print(report(result))
    return 0


def report(r) -> str:
    p, j = r["plain"], r["jakiro"]
    lines = [
        f"# jakiro serve vs plain: {r['target']} {r['dtype']}, {r['suite']}, {p['requests']} requests",
        "",
        f"Rerun: `{r['command']}` ({r['date']}; max_tokens {r['max_tokens']}, greedy, streamed, one untimed warm-up "
        "request per server, then requests alternating between the two servers, one at a time).",
        "",
        "| server | tokens/s (all) | tokens/s per request, mean / median | TTFT median | latency p50 | latency p95 |",
        "|---|---|---|---|---|---|",
    ]
    for name, s in (("plain (`--draft none`)", p), ("Jakiro", j)):
        lines.append(f"| {name} | {s['tokens_per_s_overall']:.2f} | {s['tokens_per_s_mean']:.2f} / "
                     f"{s['tokens_per_s_median']:.2f} | {s['ttft_s_median']:.3f} s | {s['latency_s_p50']:.2f} s | "
                     f"{s['latency_s_p95']:.2f} s |")
    lines += ["", f"Speedup: {r['speedup_overall']:.2f}x overall tokens/s, {r['speedup_median_per_request']:.2f}x "
              f"median per request. Jakiro text identical to plain's: {r['identical_text']}/{p['requests']}."]
    load = r.get("load")
    if load:
        lines += ["", f"Load run: {load['requests']} requests from {load['clients']} concurrent clients in "
                  f"{load['wall_s']:.0f} s: {load['correct']}/{load['requests']} answers equal to the prompt's answer "
                  f"alone, errors {len(load['errors'])}, server RSS {load['rss_mib_after_warmup']:.0f} MiB after "
                  f"warm-up, {load['rss_mib_after_load']:.0f} MiB after ({load['rss_mib_change']:+.0f} MiB)."]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
