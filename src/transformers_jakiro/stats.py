"""Acceptance statistics: what a `generate` call with a Jakiro draft did, round by round (`JakiroGenerationStats`),
and over many generations how deep the draft's tokens are accepted (`acceptance_profile`)."""

from collections.abc import Sequence
from dataclasses import asdict, dataclass, field


@dataclass
class JakiroGenerationStats:
    """What the last `generate` call did. A round is one target forward, and the prefill counts as the first round,
    accepting one token; `accepted_lengths[i]` is how many tokens round i added, bonus token included, so
    `new_tokens == sum(accepted_lengths)` and `mean_accepted_length` (tau) `== new_tokens / rounds`: tokens per target
    forward, what decides the speedup of this run.

    Papers (EAGLE, Jakiro) count only draft-verify cycles: `papers_tau` leaves out the prefill and its token,
    `sum(accepted_lengths[1:]) / draft_rounds`, and is the figure to compare with published acceptance lengths (it is
    higher, and the gap shrinks as generations get longer). Times are host wall-clock seconds."""

    new_tokens: int = 0
    rounds: int = 0
    accepted_lengths: list[int] = field(default_factory=list)
    lookup_rounds: int = 0  # rounds whose tree carried n-gram lookup nodes
    lookup_accepted: int = 0  # accepted tokens that only the n-gram lookup proposed
    draft_time_s: float = 0.0
    verify_time_s: float = 0.0
    total_time_s: float = 0.0
    # what each round verified, parallel to accepted_lengths: "prefill", then "plain", "lookup" or "tree T/D/K"
    # (`round_controller.RoundChoice.name`; the round controller's choice, or the pinned tree)
    choices: list[str] = field(default_factory=list)
    # A batch (B > 1): the whole batch's rounds above (a round's accepted length is every row's tokens together:
    # tokens per target forward), and each row's own stats here, in the caller's row order; None for one sequence.
    rows: list["JakiroGenerationStats"] | None = None

    @property
    def choice_counts(self) -> dict:
        """Rounds per choice, the prefill left out."""
        counts = {}
        for choice in self.choices[1:]:
            counts[choice] = counts.get(choice, 0) + 1
        return counts

    @property
    def mean_accepted_length(self) -> float:
        return self.new_tokens / self.rounds if self.rounds else 0.0

    @property
    def draft_rounds(self) -> int:
        """Draft-verify cycles: every round but the prefill."""
        return max(self.rounds - 1, 0)

    @property
    def papers_tau(self) -> float:
        """Tokens per draft-verify cycle, bonus token included, prefill excluded (the papers' acceptance length)."""
        return sum(self.accepted_lengths[1:]) / self.draft_rounds if self.draft_rounds else 0.0

    def record(self, accepted: int, choice: str = "prefill") -> None:
        self.rounds += 1
        self.new_tokens += accepted
        self.accepted_lengths.append(accepted)
        self.choices.append(choice)

    def as_dict(self) -> dict:
        return {
            **asdict(self),
            "mean_accepted_length": self.mean_accepted_length,
            "draft_rounds": self.draft_rounds,
            "papers_tau": self.papers_tau,
            "choice_counts": self.choice_counts,
        }


def acceptance_profile(accepted_lengths: Sequence[Sequence[int]], levels: int) -> dict:
    """From per-generation `accepted_lengths` (bonus token included; the prefill round and each generation's last
    round, which a stop may cut short, are left out): survival[d - 1] = P(at least d draft tokens accepted) and the
    per-depth acceptance rates P(d accepted | d - 1 accepted), d = 1..levels."""
    accepted = [length - 1 for lengths in accepted_lengths for length in lengths[1:-1]]
    rounds = len(accepted)
    survival = [sum(a >= d for a in accepted) / rounds if rounds else 0.0 for d in range(1, levels + 1)]
    rates = [survival[0] if levels else 0.0] + [
        survival[d] / survival[d - 1] if survival[d - 1] else 0.0 for d in range(1, levels)
    ]
    return {"rounds": rounds, "survival": survival, "acceptance_rates": rates}


def format_acceptance(survival: Sequence[float]) -> str:
    """`[0.6, 0.3]` -> "d>=1 0.60, d>=2 0.30": the share of draft rounds that accept at least d draft tokens."""
    return ", ".join(f"d>={d} {share:.2f}" for d, share in enumerate(survival, start=1))


__all__ = ["JakiroGenerationStats", "acceptance_profile", "format_acceptance"]
