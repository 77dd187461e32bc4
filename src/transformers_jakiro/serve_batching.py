"""`jakiro serve --continuous-batching`, in the server's model process: transformers' continuous batching gets the
Jakiro rounds (`continuous.JakiroContinuousBatchingManager`) and requests' stop strings reach them. The prepared
repository's shim (`serve.prepare`) calls `install_continuous_batching` where the server loads the model; nothing here
runs in the API process."""

import copy
import functools
import logging

from .serve import draft_for, log_to_stderr

logger = logging.getLogger("transformers_jakiro.serve")  # the server's per-request log, as in serve.py


def install_continuous_batching() -> None:
    """In the server's model process: `init_continuous_batching` (how `transformers serve --continuous-batching`
    starts its batching) answers a model prepared with `continuous_batching` (its config carries
    `jakiro_continuous_batching`) with `continuous_batching_manager`, every other model as before. transformers'
    server loads the model's class by name (`getattr(transformers, architectures[0])`), so no class of ours can stand
    in for it; the method is wrapped once, in this process only."""
    from transformers.generation.continuous_batching.continuous_api import ContinuousMixin

    original = ContinuousMixin.init_continuous_batching
    if getattr(original, "_jakiro", False):
        return

    def init_continuous_batching(self, generation_config=None, continuous_batching_config=None, workload_hints=None):
        settings = getattr(self.config, "jakiro_continuous_batching", None)
        if not settings:
            return original(self, generation_config, continuous_batching_config, workload_hints)
        return continuous_batching_manager(self, settings, generation_config, continuous_batching_config,
                                           workload_hints, original)

    init_continuous_batching._jakiro = True
    ContinuousMixin.init_continuous_batching = init_continuous_batching
    pass_stop_strings()


def pass_stop_strings() -> None:
    """transformers' continuous batching runner builds a request's arguments for the manager without `stop`; with
    the Jakiro manager they carry the request's stop strings and the tokenizer to match them
    (`JakiroContinuousBatchingManager.add_request`); with transformers' own (the rounds refused this model, logged) a
    request with `stop` fails by name instead of answering past its stop string."""
    from .serve_checks import continuous_batching_applies_stop

    if not continuous_batching_applies_stop():
        return  # `stop` is refused up front (serve_checks)
    from transformers.cli.serving.utils import CBGenerateRunner

    from .continuous import JakiroContinuousBatchingManager

    original = CBGenerateRunner._build_continuous_batching_kwargs
    if getattr(original, "_jakiro", False):
        return

    @functools.wraps(original)
    def build(self, generation_kwargs: dict) -> dict:
        kwargs = original(self, generation_kwargs)
        stop = generation_kwargs.get("stop_strings")
        if stop:
            if not isinstance(self.manager, JakiroContinuousBatchingManager):
                raise ValueError("`stop` is not applied by transformers' own continuous batching, which this server "
                                 "runs without the draft (see its log): leave `stop` out, or serve one request "
                                 "at a time (--no-continuous-batching).")
            kwargs.update(stop_strings=stop, tokenizer=getattr(self.processor, "tokenizer", self.processor))
        return kwargs

    build._jakiro = True
    CBGenerateRunner._build_continuous_batching_kwargs = build


def continuous_batching_manager(model, settings: dict, generation_config=None, continuous_batching_config=None,
                                workload_hints=None, plain=None):
    """What the served model's `init_continuous_batching` returns: transformers' manager with Jakiro rounds
    (`continuous.JakiroContinuousBatchingManager`) over the server's configuration, with what the rounds need set
    (async batching and CUDA graphs off; prefix sharing of prompt pages as configured; logged); transformers' own
    manager (`plain`, the unwrapped method), with a warning, where the rounds refuse (a repetition penalty in the
    generation config, another attention kernel)."""
    from transformers.generation.continuous_batching.continuous_api import ContinuousMixin

    plain = plain or ContinuousMixin.init_continuous_batching
    from .continuous import JakiroContinuousBatchingManager
    from .continuous_support import REQUIRED_SETTINGS, check_supported, jakiro_cb_config

    log_to_stderr()
    log_to_stderr("transformers_jakiro.continuous")
    log_to_stderr("transformers_jakiro.decoding.output_rows")  # the output layer's times per row count, once
    generation_config = generation_config if generation_config is not None else model.generation_config
    given = continuous_batching_config
    config = jakiro_cb_config()
    if given is not None:  # the server's sizes (--cb-num-blocks, ...), with what the rounds need set
        config = copy.copy(given)
        for name, value in REQUIRED_SETTINGS.items():
            setattr(config, name, value)
    try:
        check_supported(model, generation_config, config)
    except (ValueError, RuntimeError) as error:
        logger.warning("jakiro: continuous batching without the draft: %s", error)
        return plain(model, generation_config, given, workload_hints)
    draft = draft_for(model, settings)
    extra = {k: settings[k] for k in ("lookup_tokens",) if k in settings}
    from .decoding.drafter import TreeSettings

    manager = JakiroContinuousBatchingManager(model, draft, generation_config, config,
                                              TreeSettings.resolve(draft, **extra))
    logger.warning("jakiro: continuous batching with the Jakiro draft (async batching and CUDA graphs off; prefix "
                   "sharing %s; %s blocks, %s tokens per batch)", "on" if config.allow_block_sharing else "off",
                   config.num_blocks or "auto", config.max_batch_tokens or "auto")
    return manager


__all__ = ["continuous_batching_manager", "install_continuous_batching", "pass_stop_strings"]
