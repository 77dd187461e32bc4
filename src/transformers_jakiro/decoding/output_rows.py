"""The rows a target's forward computes logits at (its output layer's rows), and how many, chosen by what each count
costs on this machine.

On a CPU the output layer's time is not monotone in its number of rows. On a 2-core AMD EPYC, SmolLM2-135M's fp32
layer (49152 x 576) takes 6.9 ms for one row, 13.5 ms for 2, 19.9 ms for 3, 11.1 ms for 4, 21.1 ms for 7 and 11.3 ms
for 8 (the matrix library's kernels for counts that are not a multiple of 4; CB-16 in
docs/experiments/continuous-batching.md), while on an Intel Xeon at one thread 1 to 3 rows cost 4.3 ms and 4 rows
8.2 ms (RCOST-6). So the counts are measured on the layer itself, once per process (`row_costs`), and a forward that
needs n rows computes `padded_count(n)`: a count of at least n that costs clearly less, its extra rows filled with rows
whose logits may be needed (a tree's leaves) or else copies of a needed row.
"""

import logging
import time

import torch

logger = logging.getLogger(__name__)

ROW_COSTS_UP_TO = 24  # the row counts measured (1 to this); above no padding (the time grows smoothly there)
PADDING_GAIN = 0.95  # a larger count is taken only when it costs at most this share of the smaller one's time
_MEASURED: dict[tuple, list[float]] = {}


def row_costs(head: torch.nn.Module, up_to: int = ROW_COSTS_UP_TO, repeats: int = 5) -> list[float]:
    """Seconds the output layer `head` takes for 1 to `up_to` rows of hidden states (index = row count; index 0 is 0),
    the fastest of `repeats` calls each, the counts taken in turn in each repeat (so that a spell of other work on the
    machine, such as another server starting, slows one call of many counts rather than every call of a few);
    measured once per layer, dtype, device and thread count in a process."""
    weight = head.weight
    key = (weight.data_ptr(), tuple(weight.shape), weight.dtype, weight.device, torch.get_num_threads(), up_to)
    if key not in _MEASURED:
        times = [[] for _ in range(up_to + 1)]
        with torch.no_grad():
            hidden = torch.randn(1, up_to, weight.shape[1], dtype=weight.dtype, device=weight.device)
            for repeat in range(repeats + 1):  # the first round warms each count's buffers
                for rows in range(1, up_to + 1):
                    start = time.perf_counter()
                    head(hidden[:, :rows])
                    if weight.device.type == "cuda":
                        torch.cuda.synchronize(weight.device)
                    if repeat:
                        times[rows].append(time.perf_counter() - start)
        _MEASURED[key] = [0.0] + [min(each) for each in times[1:]]
        logger.info("output layer %s: ms per pass by row count 1-%d: %s", tuple(weight.shape), up_to,
                    " ".join(f"{1000 * cost:.1f}" for cost in _MEASURED[key][1:]))
    return _MEASURED[key]


def padded_count(costs: list[float] | None, rows: int) -> int:
    """The row count a forward that needs `rows` rows computes: the smallest count >= `rows` whose measured time is
    within 1/PADDING_GAIN of the cheapest count >= `rows`, if that is at most PADDING_GAIN of the time of `rows` itself;
    else `rows` (also beyond the measured counts, or without `costs`)."""
    if not costs or rows < 1 or rows >= len(costs):
        return rows
    cheapest = min(costs[rows:])
    if costs[rows] <= cheapest / PADDING_GAIN:
        return rows
    return next(count for count in range(rows, len(costs)) if costs[count] * PADDING_GAIN <= cheapest)


class ExtraLogitRows:
    """The target as transformers' continuous batching runner calls it, with `rows` appended to the rows whose logits
    the forward keeps (`logits_to_keep`, transformers' one row per request): one pass of the output layer for both,
    rather than a second product over the extra rows. The pass holds at least `pad_to` rows (`padded_count`), the
    rest copies of the runner's first row. The runner gets its own rows back; `extra` holds the logits at `rows`, in order,
    and `last` a copy of the runner's rows at places `last`, taken before the runner processes them (in place,
    maybe)."""

    def __init__(self, model, rows: torch.Tensor, last: torch.Tensor, pad_to: int | None = None):
        self.model, self.rows, self.last_rows, self.pad_to = model, rows, last, pad_to
        self.extra = self.last = None

    def __getattr__(self, name):
        return getattr(self.model, name)

    def __call__(self, **kwargs):
        keep = kwargs.get("logits_to_keep")
        if not isinstance(keep, torch.Tensor):  # only called where the runner keeps rows (checked at its first forward)
            raise RuntimeError("Jakiro continuous batching expected transformers' model runner to pass the rows to "
                               "keep logits at as `logits_to_keep` indices; this transformers version does not.")
        rows = self.rows.to(device=keep.device, dtype=keep.dtype)
        count = keep.numel() + rows.numel()
        padding = keep[:1].expand(max(0, (self.pad_to or 0) - count))
        output = self.model(**{**kwargs, "logits_to_keep": torch.cat([keep, rows, padding])})
        self.extra = output.logits[:, keep.numel() : count]
        self.last = output.logits[0, self.last_rows.to(keep.device)]
        output.logits = output.logits[:, : keep.numel()]
        return output


__all__ = ["ExtraLogitRows", "padded_count", "row_costs"]
