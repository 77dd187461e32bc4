"""The rows the target's output layer computes in a continuous-batching forward: the trees' nodes' with transformers'
own in one pass (`ExtraLogitRows`), and on a CPU a few duplicates where that count costs less (`OutputRows`).

The output layer is the largest matrix product of a small target's forward, and on a CPU its cost moves with the row
count unevenly, by the kernels' blocking: on an AMD EPYC (2 cores, SmolLM2-135M fp32, 49152 x 576) 2, 3, 6, 7, 11 and
15 rows cost 14-22 ms and 4, 8, 12 and 16 rows 11-14 ms (`benchmarks/forward_rows.py`, CB-15); on a Xeon with AMX 1 to
3 rows cost the same and 4 twice that (RCOST-6). So a forward that keeps n rows (one per request, and the trees'
nodes) may keep a few duplicate rows more where that count costs less on this machine: `OutputRows.rows_for(n)` is
the cheapest count of n to n + SLACK, each count timed once (the median of REPEATS products of this machine's output
layer over random rows) when first needed (`timing_s` adds up the time that took, which the round controller leaves
out of the round it fell in). The duplicates' logits are computed and dropped.
"""

import statistics
import time

import torch

SLACK = 3  # at most this many rows more than needed
REPEATS = 3
MAX_ROWS = 64  # above this the product's cost grows smoothly enough; counts are kept as they are


class OutputRows:
    """The row count to compute for n rows of `head` (the target's output layer), timed on this machine."""

    def __init__(self, head: torch.nn.Module, slack: int = SLACK, max_rows: int = MAX_ROWS, repeats: int = REPEATS):
        self.head, self.slack, self.max_rows, self.repeats = head, slack, max_rows, repeats
        self.seconds: dict[int, float] = {}  # per row count: the median time of one product
        self.timing_s = 0.0  # time spent timing, in all

    def rows_for(self, rows: int) -> int:
        if rows < 1 or rows > self.max_rows:
            return rows
        return min(range(rows, rows + self.slack + 1), key=lambda n: (self.cost(n), n))

    def cost(self, rows: int) -> float:
        if rows not in self.seconds:
            start = time.perf_counter()
            self.seconds[rows] = self._time(rows)
            self.timing_s += time.perf_counter() - start
        return self.seconds[rows]

    @torch.no_grad()
    def _time(self, rows: int) -> float:
        weight = self.head.weight
        hidden = torch.randn(rows, weight.shape[1], dtype=weight.dtype, device=weight.device)
        self.head(hidden)  # warm-up: the kernel picked and buffers allocated for this shape
        times = []
        for _ in range(self.repeats):
            start = time.perf_counter()
            self.head(hidden)
            times.append(time.perf_counter() - start)
        return statistics.median(times)


class ExtraLogitRows:
    """The target as transformers' model runner calls it, with `rows` appended to the rows whose logits the forward
    keeps (`logits_to_keep`, transformers' one row per request): one pass of the output layer for both, rather than a
    second product over the trees' rows; with `output_rows`, a few duplicates of the last row after them where that
    count costs less (`OutputRows`). The runner gets its own rows back; `extra` holds `rows`' logits, in order."""

    def __init__(self, model, rows: torch.Tensor | None, output_rows: OutputRows | None = None):
        self.model, self.extra, self.output_rows = model, None, output_rows
        self.rows = rows if rows is not None else torch.zeros(0, dtype=torch.long)

    def __getattr__(self, name):
        return getattr(self.model, name)

    def __call__(self, **kwargs):
        keep = kwargs.get("logits_to_keep")
        if not isinstance(keep, torch.Tensor):  # only called where the runner keeps rows (`_check_head` saw it do so)
            raise RuntimeError("Jakiro continuous batching expected transformers' model runner to pass the rows to "
                               "keep logits at as `logits_to_keep` indices; this transformers version does not.")
        kept = torch.cat([keep, self.rows.to(device=keep.device, dtype=keep.dtype)])
        if self.output_rows is not None:
            kept = torch.cat([kept, kept[-1:].expand(self.output_rows.rows_for(kept.numel()) - kept.numel())])
        output = self.model(**{**kwargs, "logits_to_keep": kept})
        self.extra = output.logits[:, keep.numel() : keep.numel() + self.rows.numel()]
        output.logits = output.logits[:, : keep.numel()]
        return output


__all__ = ["ExtraLogitRows", "OutputRows"]
