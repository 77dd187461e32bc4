"""Tree speculative decoding: the loop and everything a round is made of, one concept per module.

  * `loop`: the decoding loop both entry points run for every batch size (`jakiro_decode`), and the
    `custom_generate` entry point (`jakiro_generate`); `row_rounds`: one row's rounds (a batch of one; `verify_tree`,
    one verification round on the dynamic path); `batch_rounds`: a batch's rounds.
  * `drafter`: the tree settings and the drafter that expands one tree per round (`draft_round`: a whole draft
    round as one fixed-shape function); `batch_drafter`: the same for a batch.
  * `static_verify`: the verification round as one fixed-shape function over a static cache (`verify_round`).
  * `tree` (building, flattening, masks, paths), `verification` (acceptance rules), `kv_cache` (cache surgery),
    `logits` (processors per tree node), `lookup` (n-gram chains), `round_controller` (what each round verifies),
    `target_inputs` (checks of what generate hands over, caches, stopping verdicts), `rope` (position-dependent
    RoPE limits).
"""

from .drafter import JakiroCandidateGenerator, TreeSettings
from .loop import jakiro_decode, jakiro_generate
from .row_rounds import verify_tree
from .verification import VerifiedRound

__all__ = ["JakiroCandidateGenerator", "TreeSettings", "VerifiedRound", "jakiro_decode", "jakiro_generate", "verify_tree"]
