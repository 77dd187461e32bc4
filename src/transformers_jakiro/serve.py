"""`jakiro serve`: transformers' own OpenAI-compatible server (`transformers serve`) with the Jakiro draft attached.

    jakiro serve --target smollm2-135m-instruct --draft heads/jakiro-smollm2-135m-instruct --port 8000
    jakiro serve --target smollm2-135m-instruct --draft none           # the same server, plain decoding

Route, and why it is this one
-----------------------------
Nothing here is a web server. The draft rides on a hook that `from_pretrained` has in every release of our range
(5.17 to 5.24, `GenerationMixin.adjust_generation_fn`): a model repository holding `custom_generate/generate.py`,
loaded with `trust_remote_code=True`, gets that file's `generate` as its `model.generate`. `transformers serve` loads
its model with `from_pretrained` (`--trust-remote-code` is passed through) and answers every chat completion with
`model.generate(**inputs, streamer=..., generation_config=..., tokenizer=...)` on one inference thread per model
(`GenerateManager` / `InferenceThread`: a FIFO queue, one generate at a time in arrival order, in 5.17 and 5.24
alike). So `prepare` writes a model repository whose `custom_generate/generate.py` is a five-line shim calling
`serve_generate` below, which runs the target's own `generate` with `custom_generate=jakiro_generate, draft=<head>`.
Everything the server does around generate -- chat template, `max_tokens`, `temperature`, `top_p`, `seed`, `stop`
(`stop_strings` + the tokenizer), streaming through its `DirectStreamer`, usage counts, cancelling a generate whose
client went away (the streamer's `put` raises), `/v1/models` -- is transformers' code, unchanged.

The other routes were thicker or less stable: the server has no draft option, its `ModelManager`/handler classes are
internal and changed between 5.17 and 5.24 (local paths, `/v1/models`, new handlers), and a web framework of our own
would duplicate all of the above.

The prepared repository is laid out as a Hugging Face cache (`<cache>/serve/<key>/hub/models--jakiro--<name>`,
its weight files symlinks to the plain copy that `targets.load_target` keeps, so nothing is copied), and the server
runs with `HF_HUB_CACHE` pointing there and `HF_HUB_OFFLINE=1`. transformers' server cannot load our GGUF-dequantized
targets from their GGUF (they come from PyPI packages, not the Hub), and a cache layout instead of a plain folder
gives the model a short name (`jakiro/smollm2-135m-instruct`) that `/v1/models` lists in 5.17 too (5.17 lists only
cached repositories; 5.24 lists a pinned model by the name it was given), and that clients send as `model`. It also
guarantees that nothing is downloaded. The same repository serves under plain `transformers serve`:
`jakiro serve ... --print-command` prints that command (environment included).

What `jakiro serve` adds around transformers' server (a wrapper of the ASGI app that `build_server` returns, applied
only if transformers still has that function; without it the server runs unwrapped):

* sampling when a request asks for it: `temperature` > 0 or `top_p` < 1 samples (OpenAI's meaning) even where the
  model's generation config does not sample (`RequestChecks.sampling_config`); transformers alone answers greedily.
* request checks that transformers does not make, answered with an OpenAI-style 400 before generation starts, for
  streamed requests too: `max_tokens`/`max_completion_tokens` not a positive integer, `temperature` < 0, `top_p`
  outside (0, 1], `messages` not a list of messages, a prompt as long as the model's context or longer (or with
  `max_tokens` past it). Malformed JSON (422), an unknown model (400) and unknown fields (422) are transformers' own.
* one log line per request from `serve_generate`: tokens, tau, rounds, draft and verify time, tokens/s; or that the
  client went away and the generate was cancelled.
* the draft loaded and one short generate run before the port opens, so the first request pays no set-up.
* sampled requests decode with the head's pinned tree (`adaptive=False`): the round controller chooses trees from
  measured times, which would make a seeded request's random draws, and so its answer, vary from run to run.

transformers 5.25 runs each model in a process of its own (an engine the API process talks to): the checks then read
the model's context and generation config from the prepared repository, the per-request lines are logged from the
engine process to the same stderr, and a stream carries usage only when the request asks for it
(`stream_options={"include_usage": true}`, OpenAI's rule).

With a draft, the server runs transformers' continuous batching by default where the Jakiro rounds can serve the
target (transformers >= 5.25, `continuous_support.refusal`): concurrent requests share each forward, each verifying
its own tree (`continuous`, `serve_batching`). Everything above describes the other mode, one request at a time
(`--no-continuous-batching`, earlier transformers, or a target the rounds refuse, which a line on stderr names):
requests never share a generate, a cache or a draft state. Seeds are transformers' behaviour in both: the server calls
`torch.manual_seed(seed)` when a request arrives, so one at a time a seeded request repeats its answer when it is not
queued behind another generate (as with plain `transformers serve`); under continuous batching concurrent requests
share the random numbers.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import os
import sys
import time
from pathlib import Path

from .serve_checks import RequestChecks

logger = logging.getLogger(__name__)

SERVE_DIR = "serve"  # under targets.cache_root()
# --continuous-batching's defaults: a KV cache of 512 pages of 32 tokens (16k tokens), 512 tokens per forward
CB_NUM_BLOCKS, CB_BLOCK_SIZE, CB_MAX_BATCH_TOKENS = 512, 32, 512
SHIM_MARKER = "jakiro-serve-shim"
SHIM = '''"""Jakiro tree speculative decoding for `transformers serve` ({marker}).

Written by `jakiro serve` (transformers_jakiro.serve.prepare): the server loads this repository with
--trust-remote-code, and transformers then makes this file's `generate` the model's `generate`."""

SETTINGS = {settings}


def generate(model, *args, **kwargs):
    from transformers_jakiro.serve import serve_generate

    return serve_generate(model, SETTINGS, *args, **kwargs)


if SETTINGS.get("continuous_batching"):  # imported where the server loads the model: its batching gets the draft
    from transformers_jakiro.serve_batching import install_continuous_batching

    install_continuous_batching()

# Imported on the thread that loaded the weights; the server decodes on a thread of its own (transformers_jakiro.openmp)
from transformers_jakiro.openmp import release_thread_pool

release_thread_pool()
'''




# ---------------------------------------------------------------- preparing the model repository




def _safe_name(name: str) -> str:
    return "".join(c if c.isalnum() or c in "-_." else "-" for c in name).strip("-.") or "model"


class Prepared:
    """A model repository for transformers' server: `model_id` inside the Hugging Face cache `hub`, `env` the
    environment the server needs to find it (offline), `trust_remote_code` whether the draft is attached."""

    def __init__(self, root: Path, model_id: str, trust_remote_code: bool, settings: dict):
        self.root = root
        self.hub = root / "hub"
        self.model_id = model_id
        self.trust_remote_code = trust_remote_code
        self.settings = settings

    @property
    def snapshot(self) -> Path:
        repo = self.hub / ("models--" + self.model_id.replace("/", "--"))
        return repo / "snapshots" / (repo / "refs" / "main").read_text().strip()

    @property
    def env(self) -> dict:
        return {"HF_HUB_CACHE": str(self.hub), "HF_HUB_OFFLINE": "1", "HF_MODULES_CACHE": str(self.root / "modules")}

    def command(self, host: str, port: int, dtype: str) -> str:
        env = " ".join(f"{k}={v}" for k, v in self.env.items())
        trust = " --trust-remote-code" if self.trust_remote_code else ""
        batching = " --continuous-batching" if self.settings.get("continuous_batching") else ""
        return f"{env} transformers serve {self.model_id}{trust}{batching} --dtype {dtype} --host {host} --port {port}"


def prepare(target: str, draft: str | None, lookup_tokens: int | None = None, cache_dir=None,
            continuous_batching: bool = False) -> Prepared:
    """Write (once) the model repository that `transformers serve` loads: the target's files (symlinks to its plain
    copy) and, with a `draft` head directory, `custom_generate/generate.py` that decodes with it; with
    `continuous_batching` the settings in the config too (`jakiro_continuous_batching`: what
    `install_continuous_batching` looks for)."""
    from .targets import META_FILE, cache_root, plain_directory

    plain, name = plain_directory(target, cache_dir)
    settings = {}
    if draft is not None:
        head = Path(draft).expanduser()
        if not (head / "config.json").is_file():
            raise FileNotFoundError(f"draft head directory not found: {head} (a folder with config.json; or --draft none)")
        settings = {"draft": str(head.resolve())}
        if lookup_tokens is not None:
            settings["lookup_tokens"] = int(lookup_tokens)
        if continuous_batching:
            settings["continuous_batching"] = True
    model_id = f"jakiro/{_safe_name(name)}" if draft is not None else f"plain/{_safe_name(name)}"
    # the templates' text too: transformers keeps imported remote code by the repository's revision (this key)
    key_text = json.dumps({"plain": str(plain.resolve()), "settings": settings, "id": model_id,
                           "code": SHIM}, sort_keys=True)
    key = hashlib.sha256(key_text.encode()).hexdigest()
    root = cache_root(cache_dir) / SERVE_DIR / f"{_safe_name(name)}-{key[:12]}"
    prepared = Prepared(root, model_id, draft is not None, settings)
    repo = prepared.hub / ("models--" + model_id.replace("/", "--"))
    snapshot = repo / "snapshots" / key[:40]
    snapshot.mkdir(parents=True, exist_ok=True)
    (repo / "blobs").mkdir(exist_ok=True)
    for item in plain.iterdir():
        if item.is_file() and item.name != META_FILE and not item.name.startswith("."):
            link = snapshot / item.name
            if not link.is_symlink() or link.resolve() != item.resolve():
                link.unlink(missing_ok=True)
                link.symlink_to(item.resolve())
    if draft is not None:
        (snapshot / "custom_generate").mkdir(exist_ok=True)
        shim = SHIM.format(marker=SHIM_MARKER, settings=repr(dict(sorted(settings.items()))))
        (snapshot / "custom_generate" / "generate.py").write_text(shim)
    if settings.get("continuous_batching"):
        config = json.loads((plain / "config.json").read_text())
        config["jakiro_continuous_batching"] = settings
        (snapshot / "config.json").unlink(missing_ok=True)
        (snapshot / "config.json").write_text(json.dumps(config, indent=2))
    (repo / "refs").mkdir(exist_ok=True)
    (repo / "refs" / "main").write_text(key[:40])  # last: the repository is complete
    return prepared


# ---------------------------------------------------------------- decoding inside the server


_DRAFTS: dict = {}  # (head, dtype, device, id(target)) -> the head bound to that target


def draft_for(model, settings: dict):
    """The Jakiro head of `settings["draft"]`, loaded once, in the dtype and on the device of the target's lm_head."""
    from .modeling_jakiro import JakiroDraftModel

    weight = model.get_output_embeddings().weight
    key = (settings["draft"], weight.dtype, weight.device, id(model))
    if key not in _DRAFTS:
        start = time.perf_counter()
        head = JakiroDraftModel.from_pretrained(settings["draft"]).to(device=weight.device, dtype=weight.dtype)
        _DRAFTS[key] = head.bind_target(model).eval()
        logger.info("jakiro: draft %s loaded (%s, %.1f s)", settings["draft"], weight.dtype, time.perf_counter() - start)
    return _DRAFTS[key]


def log_to_stderr(name: str = __name__) -> None:
    """The per-request lines at INFO on stderr, also where the model runs in a process of its own (transformers 5.25
    and later start one per model; its logging is not the server's)."""
    target = logging.getLogger(name)
    if not logging.getLogger().handlers and not target.handlers:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("%(asctime)s %(name)s %(levelname)s %(message)s"))
        target.addHandler(handler)
    target.setLevel(logging.INFO)


def serve_generate(model, settings: dict, *args, **kwargs):
    """What the server's `model.generate(...)` runs in a prepared repository: the target's own `generate` with the
    Jakiro draft (`custom_generate=jakiro_generate`), and one log line with the request's statistics."""
    from .decoding.loop import jakiro_generate

    log_to_stderr()
    draft = draft_for(model, settings)
    extra = {k: settings[k] for k in ("lookup_tokens",) if k in settings}
    config = kwargs.get("generation_config")  # 5.17-5.24 pass a config; 5.25 passes its fields as keywords too
    do_sample = kwargs.get("do_sample")
    if do_sample is None:
        do_sample = getattr(config if config is not None else model.generation_config, "do_sample", False)
    if do_sample:
        # The round controller picks each round's tree from measured times, so two runs of one seeded request could
        # draw their random numbers over different trees: sampled requests use the head's pinned tree, and a seed
        # repeats its answer (greedy answers are the target's whatever the trees, and keep the controller).
        extra["adaptive"] = False
    inputs = kwargs.get("input_ids")
    prompt = int(inputs.shape[-1]) if inputs is not None else 0
    draft.last_generation_stats = None
    start = time.perf_counter()
    try:
        output = type(model).generate(model, *args, custom_generate=jakiro_generate, draft=draft, **extra, **kwargs)
    except Exception as error:
        what = "cancelled (the client went away)" if type(error).__name__ == "_GenerationCancelled" else repr(error)
        logger.warning("jakiro request: prompt %d tokens, %s after %.2f s", prompt, what, time.perf_counter() - start)
        raise
    seconds = time.perf_counter() - start
    stats = draft.last_generation_stats
    if stats is not None:
        logger.info(
            "jakiro request: prompt %d, new %d tokens, tau %.2f, rounds %d, draft %.3f s, verify %.3f s, total %.3f s, "
            "%.1f tokens/s, rounds by kind %s", prompt, stats.new_tokens, stats.mean_accepted_length, stats.rounds,
            stats.draft_time_s, stats.verify_time_s, seconds, stats.new_tokens / seconds if seconds else 0.0,
            json.dumps(stats.choice_counts))
    return output


# ---------------------------------------------------------------- the server process (request checks: serve_checks.py)


def _loaded_model(model_manager):
    """The model transformers' ModelManager preloaded (`force_model`), or None where that is not visible."""
    for timed in list(getattr(model_manager, "loaded_models", {}).values()):
        model = getattr(timed, "model", None)
        if model is not None:
            return model
    return None


def _repository_configs(model_id: str):
    """(model config, generation config) of the served repository, read from the (offline) cache; None where absent."""
    from transformers import AutoConfig, GenerationConfig

    try:
        model_config = AutoConfig.from_pretrained(model_id)
    except (OSError, ValueError):
        model_config = None
    try:
        generation_config = GenerationConfig.from_pretrained(model_id)
    except (OSError, ValueError):
        generation_config = GenerationConfig.from_model_config(model_config) if model_config is not None else None
    return model_config, generation_config


def _warm_up(model, tokenizer) -> None:
    """One short generate through the model's (possibly Jakiro) `generate`, before the port opens."""
    import torch

    ids = tokenizer.apply_chat_template([{"role": "user", "content": "Hello"}], add_generation_prompt=True,
                                        tokenize=True, return_dict=True, return_tensors="pt")
    start = time.perf_counter()
    with torch.inference_mode():
        model.generate(input_ids=ids["input_ids"].to(model.device), attention_mask=ids["attention_mask"].to(model.device),
                       max_new_tokens=8, do_sample=False)
    logger.info("jakiro: warm-up generate %.1f s", time.perf_counter() - start)
    from .openmp import release_thread_pool

    release_thread_pool()  # this thread's torch work ends here: the server decodes on its inference thread


def _server_main(config: dict) -> int:
    """Run transformers' server (`transformers.cli.serve.Serve`) on the prepared repository, in this process."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s", stream=sys.stderr)
    logging.getLogger(__name__).setLevel(logging.INFO)
    import torch

    if config.get("threads"):
        torch.set_num_threads(int(config["threads"]))
    import transformers_jakiro  # noqa: F401 -- registers the Jakiro classes and the generate hook
    from transformers.cli import serve as tf_serve
    from transformers.utils.import_utils import is_serve_available

    if not is_serve_available():
        raise SystemExit('jakiro serve needs transformers\' serving dependencies: pip install "transformers-jakiro[serving]"')
    try:
        from transformers.cli.serving import server as tf_server
    except ImportError:
        tf_server = None
    original = getattr(tf_server, "build_server", None)
    if original is not None:

        def build_server(model_manager, *args, **kwargs):
            app = original(model_manager, *args, **kwargs)
            from transformers import AutoTokenizer

            tokenizer = AutoTokenizer.from_pretrained(config["model_id"])
            model = _loaded_model(model_manager)
            if model is not None:
                model_config, generation_config = model.config, getattr(model, "generation_config", None)
                _warm_up(model, tokenizer)
            else:  # 5.25 and later run the model in a process of its own: its configs are read from the repository
                model_config, generation_config = _repository_configs(config["model_id"])
            text_config = model_config.get_text_config(decoder=True) if model_config is not None else None
            context = getattr(text_config, "max_position_embeddings", None)
            logger.warning("jakiro: serving %s (%s) on http://%s:%d/v1", config["model_id"],
                           "Jakiro draft " + config["settings"]["draft"] if config["settings"] else "no draft",
                           config["host"], config["port"])
            batching = bool((config["settings"] or {}).get("continuous_batching"))
            return RequestChecks(app, tokenizer, context, generation_config, continuous_batching=batching)

        tf_server.build_server = build_server
    else:
        logger.warning("jakiro: transformers.cli.serving.server.build_server not found; serving without request checks")
    # uvicorn shuts down gracefully on SIGTERM/SIGINT, then raises the signal again under the handlers it found:
    # these make that a normal exit (status 0) instead of a death by signal.
    import signal

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: sys.exit(0))
    batching = {}
    if config.get("continuous_batching"):  # transformers' own flags, passed through
        batching = {"continuous_batching": True, **{name: config[name] for name in (
            "cb_num_blocks", "cb_max_batch_tokens", "cb_block_size") if config.get(name) is not None}}
    tf_serve.Serve(force_model=config["model_id"], trust_remote_code=config["trust_remote_code"], dtype=config["dtype"],
                   host=config["host"], port=int(config["port"]), log_level=config.get("log_level", "warning"),
                   device=config.get("device", "auto"), **batching)
    return 0


def _resolve_dtype(dtype: str) -> str:
    if dtype == "auto":
        from .demo import default_dtype

        return default_dtype()
    return dtype


def run(args) -> int:
    """`jakiro serve`: prepare the repository, then replace this process with transformers' server on it."""
    from .demo import find_head

    draft = args.draft
    if draft is None:
        head = find_head(args.target)
        if head is None:
            raise FileNotFoundError(f"no shipped Jakiro head for {args.target!r} under heads/: pass --draft <head dir> "
                                    "(or --draft none to serve without a draft)")
        draft = str(head)
    elif draft.lower() == "none":
        draft = None
    elif not Path(draft).expanduser().is_dir():
        raise FileNotFoundError(f"draft head directory not found: {draft} (Hub ids: download the head first, e.g. "
                                "`hf download <id> --local-dir DIR`; or --draft none)")
    dtype = _resolve_dtype(args.dtype)
    args.continuous_batching = _continuous_batching(args.target, draft, args.continuous_batching)
    prepared = prepare(args.target, draft, lookup_tokens=args.lookup_tokens,
                       continuous_batching=args.continuous_batching)
    config = {"model_id": prepared.model_id, "trust_remote_code": prepared.trust_remote_code, "dtype": dtype,
              "host": args.host, "port": args.port, "threads": args.threads, "settings": prepared.settings,
              "log_level": args.log_level, "device": args.device,
              "continuous_batching": args.continuous_batching}
    command = prepared.command(args.host, args.port, dtype)
    if args.continuous_batching:  # the KV memory sized explicitly, never transformers' share of free memory
        sizes = dict(cb_num_blocks=args.cb_num_blocks or CB_NUM_BLOCKS,
                     cb_block_size=args.cb_block_size or CB_BLOCK_SIZE,
                     cb_max_batch_tokens=args.cb_max_batch_tokens or CB_MAX_BATCH_TOKENS)
        config.update(sizes)
        command += "".join(f" --{name.replace('_', '-')} {value}" for name, value in sizes.items())
    if args.print_command:
        print(command)
        return 0
    print(f"jakiro serve: {prepared.model_id} on http://{args.host}:{args.port}/v1 (plain equivalent: {command})",
          file=sys.stderr, flush=True)
    # A fresh interpreter: the Hugging Face cache location and offline mode are read when huggingface_hub is imported.
    env = {**os.environ, **prepared.env}
    argv = [sys.executable, "-m", "transformers_jakiro.serve", json.dumps(config)]
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(sys.executable, argv, env)
    return 0  # not reached


def _continuous_batching(target: str, draft: str | None, asked: bool | None) -> bool:
    """Whether the server runs continuous batching. Asked for (--continuous-batching): yes, and with a draft it needs
    transformers >= 5.25 (refused by name before). Not asked either way: with a draft, yes where the Jakiro rounds can
    serve the target (`continuous_support.refusal`; where not, one request at a time with the draft, and a line
    saying why); without a draft, transformers' default (one request at a time)."""
    from .continuous_support import page_allocators_available, refusal

    if asked is False or (draft is None and not asked):
        return False
    if asked:
        if draft is not None and not page_allocators_available():
            import transformers

            raise SystemExit(f"jakiro serve --continuous-batching needs transformers >= 5.25 (this is "
                             f"{transformers.__version__}); serve without it (one request at a time).")
        return True
    from .targets import plain_directory

    why = refusal(plain_directory(target)[0])
    if why is not None:
        print(f"jakiro serve: one request at a time ({why})", file=sys.stderr, flush=True)
    return why is None


class ServerProcess:
    """`jakiro serve` in a child process on 127.0.0.1 and a free port (tests, benchmarks): `wait_ready()` polls
    `/health` until the port answers, `stop()` sends SIGTERM and returns the exit status; `log()` is its stderr."""

    def __init__(self, target: str, draft: str | None, dtype: str = "float32", threads: int | None = None,
                 extra: list[str] | None = None, log_path: str | os.PathLike | None = None, env: dict | None = None):
        import socket
        import subprocess
        import tempfile

        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            self.port = sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        argv = [sys.executable, "-m", "transformers_jakiro.cli", "serve", "--target", target,
                "--draft", draft or "none", "--dtype", dtype, "--host", "127.0.0.1", "--port", str(self.port)]
        if threads:
            argv += ["--threads", str(threads)]
        self.log_path = Path(log_path or tempfile.mkstemp(prefix="jakiro-serve-", suffix=".log")[1])
        self._log = open(self.log_path, "wb")
        self.process = subprocess.Popen(argv + list(extra or []), stdout=self._log, stderr=subprocess.STDOUT,
                                        env={**os.environ, **(env or {})})

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def wait_ready(self, timeout: float = 300.0) -> "ServerProcess":
        import urllib.request

        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"jakiro serve exited with {self.process.returncode}:\n{self.log()[-4000:]}")
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=2) as response:
                    if response.status == 200:
                        return self
            except OSError:
                pass
            time.sleep(0.5)
        self.stop()
        raise TimeoutError(f"jakiro serve did not answer within {timeout:.0f} s:\n{self.log()[-4000:]}")

    def stop(self, timeout: float = 30.0) -> int:
        import subprocess

        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(10)
        self._log.close()
        return self.process.returncode


def add_cli(subparsers) -> None:
    parser = subparsers.add_parser(
        "serve", help="transformers' OpenAI-compatible server (transformers serve) with the Jakiro draft attached")
    parser.add_argument("--target", default="smollm2-135m-instruct",
                        help="registry name, model directory, Hub id or .gguf file (default smollm2-135m-instruct)")
    parser.add_argument("--draft", default=None,
                        help="Jakiro head directory (default: the shipped heads/jakiro-<target>), or 'none' (plain)")
    parser.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"],
                        help="auto: bfloat16 on GPUs and CPUs with native bf16, else float32")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--lookup-tokens", type=int, default=None,
                        help="n-gram lookup tokens per round (default: the head's config)")
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's)")
    parser.add_argument("--device", default="auto", help="transformers serve --device (auto, cpu, cuda:0, ...)")
    parser.add_argument("--log-level", default="warning", help="transformers' log level in the server")
    parser.add_argument("--continuous-batching", action=argparse.BooleanOptionalAction, default=None,
                        help="transformers' continuous batching: concurrent requests share each forward, each "
                             "verifying its own Jakiro tree (transformers >= 5.25). Default: on with a draft where the "
                             "target supports it, else one request at a time")
    parser.add_argument("--cb-num-blocks", type=int, default=None,
                        help=f"KV cache pages (transformers' --cb-num-blocks; default {CB_NUM_BLOCKS})")
    parser.add_argument("--cb-max-batch-tokens", type=int, default=None,
                        help=f"tokens per forward (transformers' --cb-max-batch-tokens; default {CB_MAX_BATCH_TOKENS})")
    parser.add_argument("--cb-block-size", type=int, default=None,
                        help=f"tokens per KV page (transformers' --cb-block-size; default {CB_BLOCK_SIZE})")
    parser.add_argument("--print-command", action="store_true",
                        help="prepare, print the equivalent plain `transformers serve` command, and exit")
    parser.set_defaults(func=run)


__all__ = ["Prepared", "RequestChecks", "ServerProcess", "add_cli", "draft_for", "log_to_stderr", "prepare", "run",
           "serve_generate"]


if __name__ == "__main__":
    # The server runs on the package's module, not on this `__main__` copy: the shim imports that one.
    from transformers_jakiro.serve import _server_main as _main

    sys.exit(_main(json.loads(sys.argv[1])))
