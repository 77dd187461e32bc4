"""Logits processing per tree node.

`generate` hands the decoding loop a `LogitsProcessorList` (temperature, top-k/p, repetition penalty, min new
tokens, ...). Plain decoding applies it to one row whose prefix is the sequence so far. In a tree every node has
its own prefix: the accepted ids followed by the tokens on the path from the root to that node. Nodes of equal depth
have prefixes of equal length, so each depth is processed as one batch whose rows are those prefixes.

Only processors whose output for a row depends on nothing but that row's ids and scores can run this way. Those
from transformers that are known to be row-wise are allowed; anything else (batch-index-dependent constraints,
classifier-free guidance, watermarking, stateful processors) is refused with an error, unless its class sets
`jakiro_per_node_safe = True` to declare that it is row-wise.
"""

import copy

import torch
from transformers import LogitsProcessorList
from transformers.generation import logits_process as lp

from .tree import DraftTree

# Row-wise processors that ignore the ids entirely: a list made only of these runs on all nodes in one call,
# without grouping nodes by depth (which needs the depths on the host: a device sync per round).
_PREFIX_FREE_NAMES = (
    "TemperatureLogitsWarper",
    "TopPLogitsWarper",
    "TopKLogitsWarper",
    "TopHLogitsWarper",
    "MinPLogitsWarper",
    "TypicalLogitsWarper",
    "EpsilonLogitsWarper",
    "EtaLogitsWarper",
    "InfNanRemoveLogitsProcessor",
    "LogitNormalization",
    "SuppressTokensLogitsProcessor",
)
# Row-wise processors whose result depends on the row's own ids (its length or content).
_PREFIX_DEPENDENT_NAMES = (
    "MinLengthLogitsProcessor",
    "MinNewTokensLengthLogitsProcessor",
    "RepetitionPenaltyLogitsProcessor",
    "NoRepeatNGramLogitsProcessor",
    "SequenceBiasLogitsProcessor",
    "NoBadWordsLogitsProcessor",
    "ForcedBOSTokenLogitsProcessor",
    "ForcedEOSTokenLogitsProcessor",
    "ExponentialDecayLengthPenalty",
    "SuppressTokensAtBeginLogitsProcessor",
)
# Row-wise processors that hold per-batch state: a tensor with one entry per row of the batch `generate` was called
# with. Each depth's call below has one row per tree node of that depth, so the state is repeated to that many rows
# (`_for_rows`). Audited over every processor in the two lists above (transformers 5.17 to 5.24): only the
# repetition penalty holds such state, `prompt_ignore_length`, the left-padding length of each row (5.24 and later;
# 5.17 has no such argument); the others hold ints, token lists or tables shared by every row.
PER_ROW_STATE = {"RepetitionPenaltyLogitsProcessor": ("prompt_ignore_length",)}
PREFIX_FREE_PROCESSORS = tuple(getattr(lp, name) for name in _PREFIX_FREE_NAMES if hasattr(lp, name))
ROW_WISE_PROCESSORS = PREFIX_FREE_PROCESSORS + tuple(
    getattr(lp, name) for name in _PREFIX_DEPENDENT_NAMES if hasattr(lp, name)
)


def check_processors(processors: LogitsProcessorList) -> None:
    """Raise if any processor cannot be applied per tree node."""
    for processor in processors:
        if type(processor) in ROW_WISE_PROCESSORS or getattr(processor, "jakiro_per_node_safe", False):
            continue
        raise ValueError(
            f"{type(processor).__name__} cannot be applied per tree node by Jakiro decoding: its result may depend "
            "on more than the row's own prefix and scores (batch index, other rows, internal state). Remove it, "
            "decode without assistant_model, or, if it is row-wise, set `jakiro_per_node_safe = True` on its class."
        )


def _for_rows(processors: LogitsProcessorList, rows: int) -> LogitsProcessorList:
    """`processors` ready for a call with `rows` rows: per-batch state of one row (the batch of one that generate
    was given) repeated `rows` times, in shallow copies; the originals are untouched."""
    adapted = []
    for processor in processors:
        names = PER_ROW_STATE.get(type(processor).__name__, ())
        state = {name: getattr(processor, name, None) for name in names}
        state = {name: value for name, value in state.items() if torch.is_tensor(value) and value.shape[0] != rows}
        if state:
            processor = copy.copy(processor)
            for name, value in state.items():
                if value.shape[0] != 1:
                    raise ValueError(
                        f"{type(processor).__name__}.{name} holds state for a batch of {value.shape[0]} rows; Jakiro "
                        "decoding runs one sequence per processor list."
                    )
                setattr(processor, name, value.expand(rows, *value.shape[1:]))
        adapted.append(processor)
    return LogitsProcessorList(adapted)


def processors_for_row(processors: LogitsProcessorList, row: int) -> LogitsProcessorList:
    """`processors` as they apply to row `row` of the batch `generate` prepared them for: per-batch state
    (`PER_ROW_STATE`) cut to that row, in shallow copies, so that the row can be processed alone (a batch's rows
    decode on their own in tree decoding); the originals are untouched."""
    adapted = []
    for processor in processors:
        names = PER_ROW_STATE.get(type(processor).__name__, ())
        state = {name: getattr(processor, name, None) for name in names}
        state = {name: value for name, value in state.items() if torch.is_tensor(value) and value.shape[0] > 1}
        if state:
            processor = copy.copy(processor)
            for name, value in state.items():
                setattr(processor, name, value[row : row + 1])
        adapted.append(processor)
    return LogitsProcessorList(adapted)


def path_tokens(tree: DraftTree) -> torch.LongTensor:
    """[n, tree.levels + 1]: row i holds the tokens from the root to node i (entries past its depth are 0).

    Built without a host sync: row i scatters every node's token to that node's depth, non-ancestors as 0; one
    ancestor per depth, and token ids are >= 0, so the maximum per depth is the ancestor's token."""
    n = tree.num_nodes
    tokens_of_ancestors = torch.where(tree.ancestors, tree.tokens[None, :], 0)
    out = tree.tokens.new_zeros(n, tree.levels + 1)
    return out.scatter_reduce(1, tree.depths[None, :].expand(n, -1), tokens_of_ancestors, reduce="amax")


def process_tree_logits(
    processors: LogitsProcessorList,
    input_ids: torch.LongTensor,
    tree: DraftTree,
    logits: torch.Tensor,
    nodes: torch.LongTensor | None = None,
) -> torch.Tensor:
    """Apply `processors` to every node's logits ([n, vocab], float32) with that node's own prefix.

    `input_ids` [1, L] ends with the root token, which is already part of the sequence. With `nodes` ([m] node
    indices), `logits` holds the rows of those nodes only ([m, vocab]).
    """
    if len(processors) == 0:
        return logits
    if tree.num_nodes == 1:  # the root alone: its prefix is `input_ids`
        return _for_rows(processors, 1)(input_ids, logits.clone())
    if all(type(processor) in PREFIX_FREE_PROCESSORS for processor in processors):
        rows = logits.shape[0]
        return _for_rows(processors, rows)(input_ids.expand(rows, -1), logits.clone())  # may work in place
    if nodes is None:
        nodes = torch.arange(tree.num_nodes, device=logits.device)
    # Rows sorted by depth (already so in a breadth-first tree), so that each depth is one contiguous slice; how many
    # rows each depth has is the one thing read on the host.
    depths = tree.depths[nodes]
    order = torch.argsort(depths, stable=True)
    tokens = path_tokens(tree)[nodes[order]]
    counts = torch.bincount(depths, minlength=tree.levels + 1).tolist()
    out = torch.empty_like(logits)
    start = 0
    for depth, count in enumerate(counts):
        if count == 0:
            continue
        rows = order[start : start + count]
        prefix = torch.cat([input_ids.expand(count, -1), tokens[start : start + count, 1 : depth + 1]], dim=1)
        out[rows] = _for_rows(processors, count)(prefix, logits[rows])  # an index copy: may work in place
        start += count
    return out


__all__ = [
    "PER_ROW_STATE",
    "PREFIX_FREE_PROCESSORS",
    "ROW_WISE_PROCESSORS",
    "check_processors",
    "path_tokens",
    "process_tree_logits",
    "processors_for_row",
]
