"""Concurrent clients against four servers in turn, on the same prepared model: plain `transformers serve`
(`jakiro serve --draft none`: one request at a time), plain continuous batching (`--draft none
--continuous-batching`), `jakiro serve --no-continuous-batching` (one request at a time) and `jakiro serve
--continuous-batching` (the default with a draft from transformers 5.25 on).

    .venv/bin/python benchmarks/serve_concurrency.py --target smollm2-135m-instruct --dtype float32 --clients 1,4,8
    .venv/bin/python benchmarks/serve_concurrency.py --target qwen2.5-coder-1.5b-instruct --dtype bfloat16 \\
        --suite humaneval --clients 1,4,8

For each server and each client count C: `--requests` greedy chat completions (the suite's prompts, non-streamed,
`max_tokens` fixed) sent by C client threads, each taking the next prompt when its last answer came. Reported per
server and C: aggregate completion tokens/s (all tokens / wall time), p50/p90 latency, and whether every answer equals
the plain server's answer to the same prompt. Both continuous-batching servers get the same explicit KV memory
(`--cb-num-blocks` pages of `--cb-block-size` tokens) and batch budget (`--cb-max-batch-tokens`). Each server answers
one untimed request first and runs alone, with every core.

`--interleave R` starts the servers together instead (each learning its round costs in a file of its own in the
results folder) and, for each client count, runs every server's burst of `--requests` in turn, R times, the order
reversed every other time (A B, B A, ...): while one server works the others idle, and each pair of bursts is minutes
closer in time than servers run one after another, so a drift of the machine falls on both. Reported then: the
servers' tokens/s over all their bursts, and the ratio of each burst to the baseline's burst of the same repeat
(geometric mean, lowest and highest).

`--before DIR` with a server named `jakiro-cb@before` (any server, `@before`) runs that server from DIR/src, a
checkout of an earlier commit (`git worktree add DIR <commit>`): before and after in one run.

`--load N` then runs a load on the last server: N requests from the largest client count, streamed and not by
turns, every `--cancel-every`-th one cancelled after two chunks, every `--stop-every`-th one with a stop string;
every finished answer checked against the prompt's answer alone (with that stop string), errors, the server's memory
before and after, and its last idle line (KV pages still held).

Results go to benchmarks/results/serve-concurrency-<target>-<dtype>-<date>/: results.json (every request), load.json
and README.md (the table and the command that reruns it). Not a test: nothing here is timed in CI.
"""

import argparse
import datetime
import json
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import openai

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

from transformers_jakiro.serve import ServerProcess  # noqa: E402

SUITES = ROOT / "src" / "transformers_jakiro" / "bench" / "data"
SERVERS = ["plain", "plain-cb", "jakiro", "jakiro-cb"]


def prompts(suite: str, count: int) -> list[str]:
    lines = (SUITES / f"{suite}.jsonl").read_text().splitlines()
    found = [json.loads(line)["turns"][0] for line in lines if line.strip()]
    return [found[i % len(found)] for i in range(count)]


def ask(client, model, prompt, max_tokens, **kwargs) -> dict:
    start = time.perf_counter()
    answer = client.chat.completions.create(model=model, messages=[{"role": "user", "content": prompt}],
                                            max_tokens=max_tokens, temperature=0, **kwargs)
    return {"prompt": prompt, "text": answer.choices[0].message.content, "tokens": answer.usage.completion_tokens,
            "latency_s": time.perf_counter() - start}


def in_threads(work, arguments: list[tuple]) -> float:
    """`work(*args)` in one thread per entry of `arguments`, all at once; the wall time until the last ends."""
    start = time.perf_counter()
    threads = [threading.Thread(target=work, args=args) for args in arguments]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return time.perf_counter() - start


def run_clients(server, requests: list[str], clients: int, max_tokens: int) -> dict:
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="none", timeout=3600, max_retries=0)
    model = client.models.list().data[0].id
    rows, errors, lock, queue = [], [], threading.Lock(), list(enumerate(requests))

    def work():
        while True:
            with lock:
                if not queue:
                    return
                index, prompt = queue.pop(0)
            try:
                row = ask(client, model, prompt, max_tokens)
            except Exception as error:  # reported, not raised: the other clients go on
                with lock:
                    errors.append(f"{index}: {error!r}")
                continue
            with lock:
                rows.append({"index": index, **row})

    wall = in_threads(work, [()] * clients)
    rows.sort(key=lambda row: row["index"])
    latencies = sorted(row["latency_s"] for row in rows)
    tokens = sum(row["tokens"] for row in rows)
    return {"clients": clients, "wall_s": wall, "tokens": tokens, "tokens_per_s": tokens / wall if wall else 0.0,
            "p50_s": statistics.median(latencies) if latencies else None,
            "p90_s": latencies[min(len(latencies) - 1, int(0.9 * len(latencies)))] if latencies else None,
            "errors": errors, "rows": rows}


def merge_bursts(bursts: list[dict]) -> dict:
    """One client count's bursts of one server as one run: tokens over wall time, latencies and rows of all."""
    rows = [row for burst in bursts for row in burst["rows"]]
    latencies = sorted(row["latency_s"] for row in rows)
    tokens, wall = sum(b["tokens"] for b in bursts), sum(b["wall_s"] for b in bursts)
    return {"clients": bursts[0]["clients"], "wall_s": wall, "tokens": tokens, "tokens_per_s": tokens / wall,
            "p50_s": statistics.median(latencies) if latencies else None,
            "p90_s": latencies[min(len(latencies) - 1, int(0.9 * len(latencies)))] if latencies else None,
            "errors": [e for b in bursts for e in b["errors"]], "rows": rows,
            "bursts_tokens_per_s": [b["tokens_per_s"] for b in bursts]}


def interleaved(servers: dict, requests: list[str], counts: list[int], repeats: int, max_tokens: int) -> dict:
    """Every server's burst per client count, `repeats` times, the order reversed every other repeat."""
    names = list(servers)
    bursts = {name: {clients: [] for clients in counts} for name in names}
    for clients in counts:
        for repeat in range(repeats):
            for name in names if repeat % 2 == 0 else names[::-1]:
                burst = run_clients(servers[name], requests, clients, max_tokens)
                bursts[name][clients].append(burst)
                print(f"{name:10s} clients {clients} burst {repeat + 1}: {burst['tokens_per_s']:6.1f} tokens/s",
                      flush=True)
    return {name: [merge_bursts(bursts[name][clients]) for clients in counts] for name in names}


def tree_rss_mib(pid: int) -> float:
    """Resident memory of a process and its descendants (transformers >= 5.25 runs the model in a child process)."""
    children = {}
    for status in Path("/proc").glob("[0-9]*/status"):
        try:
            fields = dict(line.split(":", 1) for line in status.read_text().splitlines() if ":" in line)
        except OSError:
            continue
        children.setdefault(int(fields["PPid"]), []).append((int(fields["Pid"]), fields.get("VmRSS", "0 kB")))
    total, todo = 0.0, [pid]
    own = Path(f"/proc/{pid}/status").read_text()
    total += next((int(line.split()[1]) for line in own.splitlines() if line.startswith("VmRSS:")), 0) / 1024
    while todo:
        for child, rss in children.get(todo.pop(), []):
            total += int(rss.split()[0]) / 1024
            todo.append(child)
    return total


def load_run(server, suite_prompts: list[str], requests: int, clients: int, max_tokens: int, cancel_every: int,
             stop_every: int = 0) -> dict:
    """`requests` requests from `clients` threads, streamed and not by turns; every `cancel_every`-th one streamed
    and closed after two chunks (the client goes away); every `stop_every`-th one (counted from the second) with a
    word from the middle of its prompt's answer as `stop`. Each finished answer is checked against the prompt's
    answer alone, with that `stop` where it had one (asked first, one at a time); the server's memory (process tree) is
    read before and after."""
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="none", timeout=3600, max_retries=0)
    model = client.models.list().data[0].id
    reference = {p: ask(client, model, p, max_tokens)["text"] for p in dict.fromkeys(suite_prompts)}
    # with --stop-every: a word from the middle of each answer, and the answer alone with it as `stop`
    stops = {p: [text.split()[len(text.split()) // 2]] for p, text in reference.items() if stop_every and text.split()}
    stopped = {p: ask(client, model, p, max_tokens, stop=stop)["text"] for p, stop in stops.items()}
    before = tree_rss_mib(server.process.pid)
    jobs = [(i, suite_prompts[i % len(suite_prompts)]) for i in range(requests)]
    results, lock = [], threading.Lock()

    def one(i, prompt):
        messages = [{"role": "user", "content": prompt}]
        if cancel_every and i % cancel_every == cancel_every - 1:
            stream = client.chat.completions.create(model=model, messages=messages, max_tokens=max_tokens,
                                                    temperature=0, stream=True)
            for n, _ in enumerate(stream):
                if n == 1:
                    break
            stream.close()
            return "cancelled", None
        if stop_every and i % stop_every == 1 % stop_every and prompt in stops:
            return "stopped", ask(client, model, prompt, max_tokens, stop=stops[prompt])["text"]
        if i % 2:
            stream = client.chat.completions.create(model=model, messages=messages, max_tokens=max_tokens,
                                                    temperature=0, stream=True)
            return "streamed", "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
        return "whole", ask(client, model, prompt, max_tokens)["text"]

    def work(mine):
        for i, prompt in mine:
            try:
                kind, text = one(i, prompt)
                error = None
            except Exception as exc:  # recorded: an error counts against the run
                kind, text, error = "error", None, repr(exc)
            with lock:
                expected = stopped[prompt] if kind == "stopped" else reference[prompt]
                results.append({"request": i, "kind": kind, "error": error,
                                "correct": kind == "cancelled" or text == expected})

    wall = in_threads(work, [(jobs[c::clients],) for c in range(clients)])
    time.sleep(2)  # the last cancellations are carried out by the server's next step
    after = tree_rss_mib(server.process.pid)
    idle = [line for line in server.log().splitlines() if "continuous batching idle" in line]
    return {"requests": requests, "clients": clients, "wall_s": wall, "cancelled": sum(r["kind"] == "cancelled"
            for r in results), "with_stop": sum(r["kind"] == "stopped" for r in results),
            "stops_cut_answers": sum(len(stopped[p]) < len(reference[p]) for p in stopped),
            "correct": sum(r["correct"] for r in results),
            "errors": [r["error"] for r in results if r["error"]], "rss_mib_before": before, "rss_mib_after": after,
            "last_idle_line": idle[-1] if idle else None, "server_alive": server.process.poll() is None,
            "rows": sorted(results, key=lambda r: r["request"])}


def start_server(args, name: str, draft: str, batching: list[str], out: Path) -> ServerProcess:
    """`name`: one of SERVERS, with `@before` the same server run from the source tree `--before` (a checkout of an
    earlier commit), for a before/after comparison in one run."""
    kind, _, version = name.partition("@")
    if kind not in SERVERS or version not in ("", "before") or (version and not args.before):
        raise SystemExit(f"unknown server {name!r}: one of {SERVERS}, optionally with @before (needs --before)")
    env = {"PYTHONPATH": str(Path(args.before) / "src")} if version else {}
    if args.interleave:  # servers up together learn their round costs apart (else the last to save sets both's priors)
        env["JAKIRO_ROUND_COSTS"] = str(out / f"round-costs-{name}.json")
    source = Path(args.before) / "src" if version else ROOT / "src"
    # With a draft, continuous batching is the default where the `serve.py` of that source has the flag's "no" form
    one_at_a_time = ["--no-continuous-batching"] if "BooleanOptionalAction" in (
        source / "transformers_jakiro" / "serve.py").read_text() else []
    return ServerProcess(args.target, draft if kind.startswith("jakiro") else None, dtype=args.dtype,
                         threads=args.threads, extra=batching if kind.endswith("-cb") else one_at_a_time,
                         log_path=out / f"server-{name}.log", env=env)


def warmed_up(server: ServerProcess, requests: list[str]) -> ServerProcess:
    server.wait_ready(600)
    run_clients(server, requests[:1], 1, 8)  # one untimed request
    return server


def servers_in_turn(args, names, draft, batching, out, requests, counts) -> dict:
    """Each server alone, one after another: every client count, then (the last server) the load run."""
    results = {}
    for name in names:
        server = start_server(args, name, draft, batching, out)
        try:
            warmed_up(server, requests)
            results[name] = [run_clients(server, requests, clients, args.max_tokens) for clients in counts]
            if args.load and name == names[-1]:
                load = load_run(server, requests, args.load, max(counts), args.max_tokens, args.cancel_every,
                                args.stop_every)
                (out / "load.json").write_text(json.dumps(load, indent=1))
                print(f"load on {name}: {load['correct']}/{load['requests']} correct ({load['cancelled']} cancelled, "
                      f"{load['with_stop']} with stop), "
                      f"errors {len(load['errors'])}, {load['wall_s']:.0f} s, RSS {load['rss_mib_before']:.0f} -> "
                      f"{load['rss_mib_after']:.0f} MiB; {load['last_idle_line']}", flush=True)
        finally:
            server.stop()
        for run in results[name]:
            print(f"{name:10s} clients {run['clients']}: {run['tokens_per_s']:6.1f} tokens/s, p50 {run['p50_s']:.1f} s, "
                  f"p90 {run['p90_s']:.1f} s, errors {len(run['errors'])}", flush=True)
    return results


def interleaved_servers(args, names, draft, batching, out, requests, counts) -> dict:
    """The servers up together (`--interleave`), their bursts alternated (`interleaved`)."""
    servers = {}
    try:
        for name in names:  # all start loading before the first is waited for
            servers[name] = start_server(args, name, draft, batching, out)
        for server in servers.values():
            warmed_up(server, requests)
        return interleaved(servers, requests, counts, args.interleave, args.max_tokens)
    finally:
        for server in servers.values():
            server.stop()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", default="smollm2-135m-instruct")
    parser.add_argument("--draft", default=None, help="head directory (default heads/jakiro-<target>)")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--suite", default="mt_bench", choices=["mt_bench", "humaneval", "alpaca", "grounded"])
    parser.add_argument("--clients", default="1,4,8")
    parser.add_argument("--requests", type=int, default=16, help="requests per client count")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--threads", type=int, default=None, help="torch threads per server (default: torch's)")
    parser.add_argument("--cb-num-blocks", type=int, default=512)
    parser.add_argument("--cb-block-size", type=int, default=32)
    parser.add_argument("--cb-max-batch-tokens", type=int, default=512)
    parser.add_argument("--servers", default=",".join(SERVERS))
    parser.add_argument("--load", type=int, default=0,
                        help="then a load run of this many requests on the last server (0: none)")
    parser.add_argument("--cancel-every", type=int, default=5, help="in the load run, every N-th request is cancelled")
    parser.add_argument("--stop-every", type=int, default=0,
                        help="in the load run, every N-th request has a stop string (0: none)")
    parser.add_argument("--interleave", type=int, default=0,
                        help="start the servers together and alternate their bursts this many times (0: in turn)")
    parser.add_argument("--before", default=None,
                        help="a checkout of an earlier commit: servers named NAME@before run from its src/")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    if args.interleave and args.load:
        parser.error("--load runs on one server after the others; leave out --interleave for it")
    draft = args.draft or str(ROOT / "heads" / f"jakiro-{args.target}")
    date = datetime.date.today().isoformat()
    out = Path(args.out or ROOT / "benchmarks" / "results" / f"serve-concurrency-{args.target}-{args.dtype}-{date}")
    out.mkdir(parents=True, exist_ok=True)
    batching = ["--continuous-batching", "--cb-num-blocks", str(args.cb_num_blocks), "--cb-block-size",
                str(args.cb_block_size), "--cb-max-batch-tokens", str(args.cb_max_batch_tokens)]
    requests = prompts(args.suite, args.requests)
    counts = [int(c) for c in args.clients.split(",")]
    names = args.servers.split(",")
    if args.interleave:
        results = interleaved_servers(args, names, draft, batching, out, requests, counts)
    else:
        results = servers_in_turn(args, names, draft, batching, out, requests, counts)
    # the reference answers: the plain server's, else plain continuous batching's
    meta_reference = "plain" if "plain" in results else next(iter(results))
    reference = {row["prompt"]: row["text"] for run in results[meta_reference] for row in run["rows"]}
    for runs in results.values():
        for run in runs:
            same = sum(reference.get(row["prompt"]) == row["text"] for row in run["rows"])
            run["identical"] = f"{same}/{len(run['rows'])}"
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    meta = {"date": date, "commit": commit, "command": " ".join(sys.argv), "args": vars(args),
            "reference": meta_reference}
    (out / "results.json").write_text(json.dumps({"meta": meta, "results": results}, indent=1))
    (out / "README.md").write_text(report(meta, results, counts))
    print(report(meta, results, counts))
    return 0


def paired(run: dict, base: dict) -> str:
    """Each burst over the baseline's burst of the same repeat: geometric mean (lowest-highest)."""
    ratios = [a / b for a, b in zip(run["bursts_tokens_per_s"], base["bursts_tokens_per_s"])]
    mean = statistics.geometric_mean(ratios)
    return f"{mean:.2f}x ({min(ratios):.2f}-{max(ratios):.2f}, {len(ratios)} pairs)"


def report(meta, results, counts) -> str:
    base_name = "plain-cb" if "plain-cb" in results else next(iter(results))
    bursts = "bursts_tokens_per_s" in next(iter(results.values()))[0]
    lines = [f"# Concurrent clients: {meta['args']['target']} {meta['args']['dtype']}, {meta['args']['suite']}",
             "", f"{meta['date']}, commit {meta['commit']}. Rerun: `{meta['command']}`", "",
             f"{meta['args']['requests']} greedy requests of at most {meta['args']['max_tokens']} tokens per client count"
             + (f", in {meta['args']['interleave']} interleaved bursts per server (servers up together, order "
                "reversed every other burst)" if bursts else "")
             + f"; aggregate completion tokens/s; ratio against {base_name} in the same run"
             + ("; paired: each burst against the baseline's burst of the same repeat" if bursts else "")
             + f"; identical: answers equal to the `{meta['reference']}` server's (bfloat16 may differ at near-ties).",
             "", f"| server | clients | tokens/s | vs {base_name} |" + (" paired |" if bursts else "")
             + " p50 s | p90 s | identical | errors |",
             "|---|---:|---:|---:|" + ("---|" if bursts else "") + "---:|---:|---|---:|"]
    base = {run["clients"]: run for run in results.get(base_name, [])}
    for name, runs in results.items():
        for run in runs:
            other = base.get(run["clients"])
            ratio = f"{run['tokens_per_s'] / other['tokens_per_s']:.2f}x" if other else "-"
            pair = (f" {paired(run, other) if other and name != base_name else '-'} |" if bursts else "")
            lines.append(f"| {name} | {run['clients']} | {run['tokens_per_s']:.1f} | {ratio} |{pair} "
                         f"{run['p50_s']:.1f} | {run['p90_s']:.1f} | {run['identical']} | {len(run['errors'])} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
