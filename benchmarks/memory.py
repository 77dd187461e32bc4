"""Peak memory of Jakiro decoding against plain `generate` on one long prompt.

Each method runs in a fresh subprocess (same target, same prompt, same number of new tokens, one short warm-up
generation first), so that nothing one method leaves in the allocator counts against the other. What is measured:

  * on CUDA: `torch.cuda.max_memory_allocated()` during the long generation, minus what was allocated before it;
  * on CPU: the process's peak resident set size (VmHWM, reset through /proc/self/clear_refs right before the long
    generation) minus its resident size at that moment. Without a resettable peak (not Linux), RSS is sampled every
    millisecond instead, which can miss short spikes.

Both numbers are what the generation adds on top of the loaded models (weights are the same for both methods and
excluded), so the ratio is the one a long-context user feels: the KV cache, activations, masks, captured hidden states.

    OMP_NUM_THREADS=2 python benchmarks/memory.py --target smollm2-135m-instruct --prompt-tokens 8192 \
        --new-tokens 16 --out benchmarks/results/memory-smollm2-135m-cpu-fp32-8k

`--target tiny` uses a random 2-layer Llama (fast, but a one-layer draft is half the size of such a target, so the
ratio says little); `--draft random` (default) an untrained head (memory does not depend on the weights).
"""

import argparse
import json
import os
import platform
import shlex
import subprocess
import sys
import threading
import time
from pathlib import Path

METHODS = ("plain", "jakiro")


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _peak_rss_bytes() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmHWM in /proc/self/status")


def _reset_peak_rss() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # resets the peak resident set size (Linux >= 4.0)
        return True
    except OSError:
        return False


class _Sampler:
    """Fallback peak tracker: samples RSS every millisecond on a thread."""

    def __init__(self):
        self.peak, self._stop = _rss_bytes(), threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self):
        while not self._stop.is_set():
            self.peak = max(self.peak, _rss_bytes())
            time.sleep(0.001)

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()


def load(target_name: str, draft_name: str, dtype, device: str):
    import torch

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
    from transformers_jakiro import JakiroDraftModel

    if target_name == "tiny":
        from tiny_models import make_target

        target = make_target("llama", dtype=dtype, max_position_embeddings=1 << 16).to(device)
    else:
        from transformers_jakiro.targets import load_target

        target, _ = load_target(target_name, dtype=dtype)
        target = target.to(device)
    if draft_name == "random":
        torch.manual_seed(0)
        draft = JakiroDraftModel.from_target(target)
    else:
        draft = JakiroDraftModel.from_pretrained(draft_name, dtype=dtype).to(device).bind_target(target)
    return target.eval(), draft.eval()


def measure_one(args) -> dict:
    """Runs in the subprocess: one method, one long generation."""
    import torch

    dtype = getattr(torch, args.dtype)
    target, draft = load(args.target, args.draft, dtype, args.device)
    vocab = target.config.get_text_config(decoder=True).vocab_size
    generator = torch.Generator().manual_seed(0)
    prompt = torch.randint(3, vocab, (1, args.prompt_tokens), generator=generator).to(args.device)
    kwargs = dict(do_sample=False, max_new_tokens=args.new_tokens, min_new_tokens=args.new_tokens)
    if args.method == "jakiro":
        kwargs["assistant_model"] = draft
    with torch.no_grad():
        target.generate(prompt[:, :32], **{**kwargs, "max_new_tokens": 4, "min_new_tokens": 4})  # warm-up
    result = {"method": args.method}
    start = time.perf_counter()
    if args.device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        with torch.no_grad():
            out = target.generate(prompt, **kwargs)
        torch.cuda.synchronize()
        result.update(peak_added_bytes=torch.cuda.max_memory_allocated() - before, how="cuda max_memory_allocated")
    else:
        before = _rss_bytes()
        if _reset_peak_rss():
            with torch.no_grad():
                out = target.generate(prompt, **kwargs)
            result.update(peak_added_bytes=_peak_rss_bytes() - before, how="VmHWM after clear_refs")
        else:
            with _Sampler() as sampler, torch.no_grad():
                out = target.generate(prompt, **kwargs)
            result.update(peak_added_bytes=sampler.peak - before, how="RSS sampled every 1 ms")
        result["rss_before_bytes"] = before
    result["seconds"] = round(time.perf_counter() - start, 2)
    result["new_tokens"] = out.shape[1] - prompt.shape[1]
    result["output_tail"] = out[0, -args.new_tokens :].tolist()
    if args.method == "jakiro":
        result["tau"] = round(draft.last_generation_stats.mean_accepted_length, 3)
    return result


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", default="smollm2-135m-instruct", help="'tiny' or a transformers_jakiro target")
    parser.add_argument("--draft", default="random", help="'random' (untrained head) or a head directory")
    parser.add_argument("--prompt-tokens", type=int, default=8192)
    parser.add_argument("--new-tokens", type=int, default=16)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--out", type=Path, default=None, help="directory for results.json and results.md")
    parser.add_argument("--method", choices=METHODS, help=argparse.SUPPRESS)  # internal: run one method
    args = parser.parse_args(argv)

    if args.method:
        print(json.dumps(measure_one(args)))
        return {}

    rows = []
    for method in METHODS:
        command = [sys.executable, __file__, *(argv if argv is not None else sys.argv[1:]), "--method", method]
        done = subprocess.run(command, capture_output=True, text=True, env=os.environ.copy())
        if done.returncode != 0:
            raise RuntimeError(f"{method} failed:\n{done.stderr[-4000:]}")
        rows.append(json.loads(done.stdout.strip().splitlines()[-1]))
    plain, jakiro = rows
    result = {
        "command": "python benchmarks/memory.py " + shlex.join(argv if argv is not None else sys.argv[1:]),
        "target": args.target,
        "draft": args.draft,
        "prompt_tokens": args.prompt_tokens,
        "new_tokens": args.new_tokens,
        "dtype": args.dtype,
        "device": args.device,
        "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS"),
        "machine": platform.platform(),
        "plain": plain,
        "jakiro": jakiro,
        "ratio": round(jakiro["peak_added_bytes"] / plain["peak_added_bytes"], 3),
        "identical_outputs": plain["output_tail"] == jakiro["output_tail"],
    }
    mib = lambda row: f"{row['peak_added_bytes'] / 2**20:.0f} MiB"  # noqa: E731
    table = (
        f"Peak memory added by one generation: {args.target}, {args.prompt_tokens}-token prompt, {args.new_tokens} "
        f"new tokens, {args.dtype}, {args.device} ({plain['how']}).\n\n"
        "| method | peak added | seconds | tau |\n|---|---:|---:|---:|\n"
        f"| plain generate | {mib(plain)} | {plain['seconds']} | |\n"
        f"| Jakiro | {mib(jakiro)} | {jakiro['seconds']} | {jakiro.get('tau', '')} |\n\n"
        f"Jakiro / plain: **{result['ratio']}x**. Identical output tokens: {result['identical_outputs']}.\n\n"
        f"Command: `{result['command']}` (OMP_NUM_THREADS={result['OMP_NUM_THREADS']})\n"
    )
    print(table)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "results.json").write_text(json.dumps(result, indent=2) + "\n")
        (args.out / "results.md").write_text("# Memory: Jakiro vs plain generate\n\n" + table)
    return result


if __name__ == "__main__":
    main()
