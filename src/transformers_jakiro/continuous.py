"""Jakiro rounds inside transformers' continuous batching: concurrent requests share each target forward, every
decoding request verifying its own tree in it.

transformers' continuous batching (`transformers.generation.continuous_batching`) packs the queries of every scheduled
request into one row (`cu_seq_lens_q`) over a paged KV cache; under `sdpa` the attention mask is a dense additive
tensor with one block per request. A decoding request normally brings its last token. Here it brings its tree, root
(its last token) first: the scheduler takes `tokens_to_process` as it is and gives the request a slot per node; after
packing, the request's positions become prefix + depth and its mask block the tree's ancestor mask; the logits at
every node (the target's output layer over the nodes' hidden states) go through the one-row acceptance rule
(`decoding.verification.verify`); the accepted path's KV entries move to the front of the request's written slots,
its length rolls back to the path (`position_offset`) and pages past it go back to the pool; its tokens are appended
one by one with transformers' own check after each (EOS, `max_new_tokens`), then the request's stop strings. The
decoding requests draft together: one `BatchDrafter` whose rows are the requests (a row joins when its request's
prefill ends, with the prompt's features, chunks included; it leaves when the request finishes or is cancelled), so
a tree round runs each draft forward once for all of them. Tree sizes shrink as more requests decode
(`round_controller.batch_tree`), and requests take plain steps when the batch's token budget could not hold every
tree.

Nothing of transformers is patched. `JakiroContinuousBatchingManager` is transformers' manager; the batch processor it
builds (by name, inside transformers) becomes a `JakiroBatchProcessor`, a subclass that adds the rounds. The private
attributes this touches are checked before any work (`continuous_support`), with a clear error on transformers
versions that lay them out otherwise.

Sampling: every tree node's logits go through the batch's own logits processors with the request's settings
(transformers' per-request temperature, top-k and top-p when `per_request_processors`), and the one-row rule accepts
by sampling the target's pick at every node (`decoding.verification`), so each token is drawn from the target's
processed distribution given its prefix; plain steps and first tokens are transformers' own samples. Processors that
depend on the prefix are refused by name (continuous batching applies them to one token, not to the sequence).
"""

import dataclasses
import functools
import itertools
import json
import logging
import time

import torch
from transformers import ContinuousBatchingConfig, GenerationConfig, StopStringCriteria
from transformers.generation.continuous_batching.continuous_api import ContinuousBatchingManager, ContinuousBatchProcessor
from transformers.generation.continuous_batching.requests import RequestStatus

from .continuous_support import check_layout, check_supported, jakiro_cb_config
from .decoding import verification
from .decoding.batch_drafter import BatchDrafter
from .decoding.drafter import TreeSettings
from .decoding.output_rows import ExtraLogitRows, padded_count, row_costs
from .decoding.row_rounds import LAZY_LEAVES_MIN_NODES
from .decoding.round_controller import (PinnedController, RoundChoice, RoundController, batch_tree, choices_for,
                                        load_costs, machine_key, save_costs)
from .features import TargetFeatures
from .openmp import release_thread_pool
from .paged_kv import move_slots
from .shared_pages import SharedPageFeatures
from .stats import JakiroGenerationStats

logger = logging.getLogger(__name__)

# A request copies an earlier passage when this many of its rounds in a row continued its lookup chain
COPY_RUN_AFTER = 3

class JakiroBatchProcessor(ContinuousBatchProcessor):
    """transformers' batch processor with Jakiro rounds (see the module docstring). Made from the processor
    transformers builds, by `attach`: its class is set to this one, its state kept."""

    def attach(self, target, draft, settings: TreeSettings) -> None:
        check_layout(self)
        self.target, self.draft, self.settings = target, draft, settings
        self.feature_layers = draft.config.target_feature_layers
        # The trees' logits: the forward keeps them with the row per request that transformers samples from, in the
        # same pass of the output layer (`output_rows.ExtraLogitRows`; on a CPU each pass reads the whole layer: 14 ms
        # for Qwen2.5-Coder-1.5B's in bf16 on a 2-core EPYC, CB-9). The output layer alone gives a lazy leaf's logits
        # where it reproduces the target's; where it does not (a model that scales or caps logits after it) the forward
        # keeps every row's.
        self.head = target.get_output_embeddings()
        self.head_checked = False
        # On a CPU a row of the output layer costs as much as several of a small target's layers: logits at a tree's
        # internal nodes only, and at the one leaf where an accepted path ends (as `row_rounds.lazy_leaf_head`), when
        # the forward holds one tree (`_lazy_tree`).
        self.lazy_leaves = target.get_input_embeddings().weight.device.type == "cpu"
        # There a pass's row count is padded to one that costs less on this machine (`output_rows.padded_count`)
        self.row_costs = row_costs(self.head) if self.lazy_leaves and self.head is not None else None
        self._internal, self._kept_leaves = {}, {}  # this step's lazy tree: its internal nodes, leaves the pass holds
        self.drafter = BatchDrafter(draft, settings, 0)
        self.rows: list[str] = []  # the drafter's rows: the requests that decode
        self.trees = {}  # request id -> (the tree it brings to the next forward, the round's name)
        self.prefill_features: dict[str, list[torch.Tensor]] = {}  # chunks of a prompt whose prefill is split
        self.shared_pages = SharedPageFeatures()  # features and draft entries of prompt pages later prompts may share
        self.drafter.keep_first_reads = self.cache.use_prefix_sharing  # the draft's entries of prompts it reads
        self.request_stats: dict[str, JakiroGenerationStats] = {}  # per request: its rounds, as `generate`'s stats
        self.finished_stats: dict[str, JakiroGenerationStats] = {}
        self._logits = self._features = None
        self.controllers = {}  # per number of decoding requests (a power of two): its round controller
        self._chosen = None  # (controller, choice, requests) of the round drafted last
        self._round_started = None
        self._catch_up_s = 0.0
        self._idle = False  # since the last idle line, nothing was scheduled
        self._starts = []  # this step's query rows per request: request i has rows [starts[i], starts[i + 1])
        self.pending_stops: dict[str, StopStringCriteria] = {}  # the manager's: stop strings of requests not yet here
        self.stop_criteria: dict[str, StopStringCriteria] = {}  # per decoding request with stop strings
        self.copy_streak: dict[str, int] = {}  # per request: its last rounds in a row that continued its lookup chain

    def prepare_next_batch(self) -> bool:
        """transformers' packing, then each tree's positions (prefix + depth) and its block of the mask."""
        scheduled = super().prepare_next_batch()
        self._after_offloads()
        if not scheduled:
            self._went_idle()
            return False
        self._idle = False
        io = self.inputs_and_outputs
        batch = io.requests_in_batch
        self._starts = io.cumulative_seqlens_q[: len(batch) + 1].tolist()  # read once, used through the update
        if not any(future.state.request_id in self.trees for future in batch):
            return True
        starts_q = self._starts
        ends_k = io.cumulative_seqlens_k["full_attention"][: len(batch) + 1].tolist()
        mask = io.attention_mask["full_attention"]
        for i, future in enumerate(batch):
            tree, _ = self.trees.get(future.state.request_id, (None, None))
            if tree is None:
                continue
            n, q0, k1 = tree.num_nodes, starts_q[i], ends_k[i + 1]
            if future.query_length != n:
                raise RuntimeError(f"A tree of {n} nodes was scheduled as {future.query_length} tokens.")
            past = future.state.position_offset - n  # the packing advanced it by the whole tree
            io.position_ids[q0 : q0 + n] = (past + tree.depths).to(io.position_ids.dtype)
            block = torch.full((n, n), torch.finfo(mask.dtype).min, dtype=mask.dtype, device=mask.device)
            mask[0, 0, q0 : q0 + n, k1 - n : k1] = block.masked_fill(tree.ancestors.to(mask.device), 0.0)
        return True

    def _check_head(self) -> None:
        """Once, at the first forward: whether the output layer alone reproduces the logits the forward kept (at the
        rows of `logits_indices`); if not, every later forward keeps every row's logits."""
        self.head_checked = True
        if self.head is None or self._logits.shape[1] == self._features.shape[0]:
            self.head = None
            self.model_runner._model_supports_logits_to_keep = False
            return
        io = self.inputs_and_outputs
        rows = io.logits_indices[: self._logits.shape[1]].long()
        hidden = self._features[rows, -self.head.weight.shape[1] :]
        if not torch.allclose(self.head(hidden).float(), self._logits[0].float(), rtol=1e-3, atol=1e-3):
            self.head = None
            self.model_runner._model_supports_logits_to_keep = False

    def _tree_rows_to_keep(self) -> tuple[torch.Tensor, torch.Tensor, int | None] | None:
        """The rows this forward keeps besides transformers' own (a request's last query row, a tree's last node): a
        tree's other nodes, a lone tree's on a CPU its internal ones (`_lazy_tree`); the trees' last nodes' places among
        transformers' rows; and the row count the pass is padded to (`output_rows.padded_count`), the lone tree's leaves
        first. None where no row is added (or every row is kept: `_node_logits`)."""
        self._tree_rows, self._internal, self._kept_leaves = {}, {}, {}
        if self.head is None:
            return None
        batch, starts = self.inputs_and_outputs.requests_in_batch, self._starts
        lazy = self._lazy_tree([future.state.request_id for future in batch])
        rows, last, at, kept = [], [], 0, 0
        for i, future in enumerate(batch):
            request = future.state.request_id
            if request in self.trees:
                tree = self.trees[request][0]
                nodes = tree.internal_nodes().cpu() if request == lazy else torch.arange(tree.num_nodes - 1)
                rows.append(starts[i] + nodes)
                last.append(kept)  # the last node's logits: transformers' row of this request
                self._tree_rows[starts[i]] = (at, len(last) - 1)
                at += nodes.numel()
                if request == lazy:
                    self._internal[request], lazy_start, lazy_tree = nodes, starts[i], tree
            kept += future.has_new_token
        count = kept + at  # the runner keeps a row per request with a new token
        # Not before the first forward's check of the output layer (`_check_head`), which compares the runner's rows
        padded = padded_count(self.row_costs, count) if self.head_checked and self.row_costs else None
        if lazy is not None and padded is not None and padded > count:
            leaves = [node for node in lazy_tree.leaves().tolist() if node != lazy_tree.num_nodes - 1][: padded - count]
            rows.append(lazy_start + torch.tensor(leaves, dtype=torch.long))
            self._kept_leaves = {node: at + place for place, node in enumerate(leaves)}
        if not rows and (padded is None or padded == count):
            return None
        rows = torch.cat(rows) if rows else torch.zeros(0, dtype=torch.long)
        return rows, torch.tensor(last, dtype=torch.long), padded

    def _lazy_tree(self, requests: list[str]) -> str | None:
        """The request whose leaves get their logits lazily in this forward, if any: on a CPU, the one request that
        brings a tree, of LAZY_LEAVES_MIN_NODES nodes or more. With several trees each request whose path ends at a
        leaf would pay a one-row product of the whole output layer of its own, while a product over the leaves' rows
        too is one pass that costs about what a few rows' does (SmolLM2 fp32 on a Xeon: 1 to 3 rows the same, 7 to 16
        rows 3x one row, RCOST-6); and a tree of a few nodes gains nothing from it either."""
        trees = [request for request in requests if request in self.trees]
        if not self.lazy_leaves or len(trees) != 1 or self.trees[trees[0]][0].num_nodes < LAZY_LEAVES_MIN_NODES:
            return None
        return trees[0]

    def _node_logits(self, request: str, rows: slice) -> torch.Tensor:
        """[nodes, vocab] float32 logits at the query rows `rows` (one request's tree); with `lazy_leaves`, at its
        internal nodes only (`self._internal[request]`)."""
        if self.head is None:
            return self._logits[0, rows].float()
        at, last = self._tree_rows[rows.start]
        if request in self._internal:
            return self._tree_logits[at : at + self._internal[request].numel()]
        return torch.cat([self._tree_logits[at : at + rows.stop - rows.start - 1], self._last_logits[last : last + 1]])

    @torch.no_grad()
    def _generation_step(self, model) -> None:
        """transformers' step, keeping the logits its forward computes, the trees' among them (`_tree_rows_to_keep`),
        and the draft's features (hooks)."""
        rows = self._tree_rows_to_keep()
        called = model if rows is None else ExtraLogitRows(model, *rows)
        with TargetFeatures(model, self.feature_layers) as hidden:
            if hidden.decoder is None:
                raise ValueError("Jakiro continuous batching needs a target with a decoder module to hook.")
            handle = model.register_forward_hook(lambda module, args, output: setattr(self, "_logits", output.logits))
            try:
                super()._generation_step(called)
            finally:
                handle.remove()
            self._features = hidden.take(None)[0]  # [queries, width]
        if rows is not None:
            self._tree_logits, self._last_logits = called.extra[0].float(), called.last.float()
        if not self.head_checked:
            self._check_head()

    def update_batch(self) -> None:
        """Every request's new tokens: a prefill chunk's none, a plain step's one, a tree's accepted path and bonus
        token; then each request still decoding drafts the tree it brings to the next forward."""
        io = self.inputs_and_outputs
        self._forget_gone()
        batch, new_tokens, _ = io.prepare_batch_update()
        starts = self._starts
        logits_index, outputs, decoding = 0, [], []
        counts, chains = {}, {}  # per request that ran the last chosen round: its tokens, its lookup-only tokens
        for i, future in enumerate(batch):
            state, rows = future.state, slice(starts[i], starts[i + 1])
            request = state.request_id
            if not future.has_new_token:  # a chunk of a split prefill
                self.prefill_features.setdefault(request, []).append(self._features[rows])
                continue
            token = new_tokens[logits_index]
            logits_index += 1
            tree, name = self.trees.pop(request, (None, None))
            if state.generated_len() == 0:  # the prefill ended: the first token, and the request's draft row
                state.status = RequestStatus.DECODING
                chunks = [*self.prefill_features.pop(request, []), self._features[rows]]
                features = self.shared_pages.prompt_features(self.cache, state, chunks)
                tokens, name = [token], "prefill"
                self.shared_pages.share(self.cache, state, features)
                if features is not None:  # a draft row; with prefix sharing, the draft's entries kept for its pages
                    self.drafter.add_rows(1)
                    self.rows.append(request)
                    start = self.shared_pages.preload_draft(self.cache, state, self.drafter, len(self.rows) - 1)
                    context = list(state.initial_tokens) + tokens
                    self._observe(request, features[start:], context[1 + start :], context)
                self.request_stats.setdefault(request, JakiroGenerationStats())
                if request in self.pending_stops:
                    self.stop_criteria[request] = self.pending_stops.pop(request)
            elif tree is None:  # a plain step
                tokens, name = [token], "plain"
                self._observe(request, self._features[rows], tokens, tokens)
                counts[request], chains[request] = 1, 0
            else:
                tokens, accepted, lookup = self._verify(future, tree, rows)
                self._observe(request, self._features[rows][accepted], tokens, tokens, lookup)
                counts[request], chains[request] = len(tokens), lookup or 0
            finished, count, stop = False, 0, self.stop_criteria.get(request)
            for new in tokens:  # transformers' own checks (EOS, max_new_tokens) after every token, then stop strings
                finished = state.update_and_check_completion(new, None)
                count += 1
                if not finished and stop is not None and _stops(stop, state):
                    state.status, finished = RequestStatus.FINISHED, True
                if finished:
                    break
            self.request_stats[request].record(count, name)
            if finished:
                self.scheduler.finish_request(request)
                self.scheduler.block_new_requests = False
                self.stop_criteria.pop(request, None)
                stats = self.finished_stats[request] = self.request_stats.pop(request)
                logger.info("jakiro request %s: prompt %d, new %d tokens, tau %.2f, rounds %d, rounds by kind %s",
                            request, len(state.initial_tokens), stats.new_tokens, stats.mean_accepted_length,
                            stats.rounds, json.dumps(stats.choice_counts))
            else:
                decoding.append(state)
            if state.streaming or finished:
                outputs.append(state.to_generation_output())
        if outputs:
            self.output_router.deliver_batch(outputs)
        self._record_round(batch, counts, chains)
        self._keep_rows(self._alive())  # finished requests' rows leave
        self._draft_trees(decoding)

    def _after_offloads(self) -> None:
        """Requests that transformers offloaded under cache pressure (they wait to be scheduled again) give up the
        tree they were to bring. One whose cache went to the CPU resumes by processing its root alone (what it would
        have processed without a draft; its draft row stays). One reset to a new prompt (its tokens so far, prefilled
        again) gets a new draft row when that prefill ends."""
        for request, state in self.scheduler.waiting_requests.items():
            tree, _ = self.trees.pop(request, (None, None))
            if state.generated_len() == 0 and request in self.rows:  # reset: prefilled again from its tokens so far
                self._keep_rows(set(self.rows) - {request})
            elif tree is not None and state.remaining_prefill_tokens == tree.tokens.tolist():
                state.remaining_prefill_tokens = state.remaining_prefill_tokens[:1]

    def _went_idle(self) -> None:
        """Nothing to schedule: the draft state of requests cancelled since the last step goes, and once per idle
        spell the round controllers' costs go to the per-machine cache and a log line says what requests still hold
        (0 everywhere when nothing leaked)."""
        self._forget_gone()
        if not self._idle:
            self._idle = True
            self.shared_pages.prune(self.cache)
            for controller in self.controllers.values():
                if isinstance(controller, RoundController):
                    save_costs(controller.key, controller.learned_costs())
            logger.info("jakiro continuous batching idle: %d KV pages held, %d draft rows, %d trees",
                        self.held_pages(), len(self.rows), len(self.trees))

    def held_pages(self) -> int:
        """KV pages that some request holds (in its page table)."""
        return sum(len(table) for allocator in self.cache.cache_allocators.values()
                   for table in allocator.block_table.values())

    def _forget_gone(self) -> None:
        """Drop the draft state of requests that left without finishing here (cancelled, failed); requests that
        wait (offloaded under cache pressure, to be restored with their tokens) keep theirs."""
        alive = self._alive()
        for table in (self.trees, self.prefill_features, self.request_stats, self.copy_streak, self.stop_criteria,
                      self.shared_pages.unread):
            for request in [request for request in table if request not in alive]:
                del table[request]
        self._keep_rows(alive)

    def _alive(self) -> set:
        return set(self.scheduler.active_requests) | set(self.scheduler.waiting_requests)

    def _keep_rows(self, requests: set) -> None:
        """The draft rows of these requests stay, the others leave."""
        keep = [row for row, request in enumerate(self.rows) if request in requests]
        if len(keep) < len(self.rows):
            self.drafter.select(keep)
            self.rows = [self.rows[row] for row in keep]

    def _observe(self, request: str, features: torch.Tensor, next_tokens: list[int], tokens: list[int],
                 lookup: int | None = None) -> None:
        """A request's accepted positions for its draft row: the target's features there and the token after each."""
        if request not in self.rows:  # never had one (it cannot be rebuilt without its prompt's features)
            return
        device = self.draft.fc.weight.device
        row = self.rows.index(request)
        self.drafter.observe(row, features, torch.tensor(next_tokens, device=device), tokens, lookup)
        self.copy_streak[request] = self.copy_streak.get(request, 0) + 1 if self.drafter.copied[row] else 0

    def _verify(self, future, tree, rows):
        """A tree's round: the acceptance rule on its nodes' logits, its path's KV entries kept, the rest released.
        Returns the new tokens (host ids), the accepted nodes and how many of them only the n-gram lookup proposed."""
        n = tree.num_nodes
        state = future.state
        logits = self._processed(future, self._node_logits(state.request_id, rows))
        leaf_logits = None
        if state.request_id in self._internal:  # leaves' logits: only where the accepted path ends, one row
            last = self._tree_rows[rows.start][1]  # its last node's place among transformers' rows

            def leaf_logits(node: torch.LongTensor) -> torch.Tensor:
                node = int(node)
                if node == n - 1:  # the tree's last node: transformers' row
                    return self._processed(future, self._last_logits[last : last + 1])[0]
                if node in self._kept_leaves:  # a leaf the pass's padding held
                    return self._processed(future, self._tree_logits[self._kept_leaves[node]][None])[0]
                hidden = self._features[rows.start + node, -self.head.weight.shape[1] :]
                return self._processed(future, self.head(hidden[None]).float())[0]

        path, bonus = verification.verify(tree, logits, self.do_sample, leaf_logits)
        host = torch.cat(verification.path_packet(tree, path, bonus)).tolist()  # the round's one read
        m, tokens, lookup = verification.read_path_packet(host, path.numel(), tree.from_lookup is not None)
        past = state.position_offset - n
        self._keep_path(state.request_id, past, n, host[:m])
        state.position_offset = past + m
        return tokens, path[:m], lookup

    def _processed(self, future, logits: torch.Tensor) -> torch.Tensor:
        """Tree nodes' logits ([nodes, vocab]) through the batch's logits processors, each with the request's own
        settings (the per-request processors' argument repeated for every node), as transformers processes a plain
        step's. The processors are row-wise and ignore the ids (`check_supported`)."""
        processors = self.logit_processor
        if not processors.do_processing:
            return logits
        nodes = logits.shape[0]
        # transformers' own packing of the request's arguments (one column), then repeated for every node
        args = processors.prepare_tensor_args([future], torch.zeros((max(processors.tensors_required, 1), 1),
                                                                    dtype=torch.int32))
        ids = torch.zeros(nodes, dtype=torch.long, device=logits.device)
        return processors(ids, logits, args.expand(-1, nodes).to(logits.device))

    def _keep_path(self, request: str, past: int, n: int, nodes: list[int]) -> None:
        """The accepted nodes' KV entries moved to the first of the tree's slots, in path order, in every layer at
        once (`paged_kv.move_slots`); the pages after the kept length go back to the pool."""
        kept = past + len(nodes)
        for allocator in self.cache.cache_allocators.values():
            slots = allocator.get_write_indices(request, past, n)
            move_slots(allocator, [slots[node] for node in nodes], slots[: len(nodes)])
            table = allocator.block_table[request]
            pages = -(-kept // allocator.tokens_per_page)
            tail = table[pages:]
            del table[pages:]
            allocator.pool.free_blocks(allocator.index, [page for page in tail if allocator.ledger.release(page)])

    def _controller(self, decoding: int):
        """The round controller for this many decoding requests (rounded up to a power of two): its choices are the
        configured tree's node budget shared by the requests (`round_controller.batch_tree`), a smaller tree (a lone
        request's grown to fill its forward, `output_rows`), lookup chains alone and a plain step, chosen by measured
        tokens per second (`round_controller.RoundController`), with the round costs this machine measured before at
        this count as priors (the per-machine cache, saved when the batch goes idle), so that a new server does not
        start by trying every choice again."""
        bucket = 1 << (decoding - 1).bit_length()
        if bucket not in self.controllers:
            settings = self.settings
            total, depth, top_k = batch_tree(settings.total_tokens, settings.depth, settings.top_k, bucket)
            if not settings.adaptive:
                self.controllers[bucket] = PinnedController(RoundChoice("tree", total, depth, top_k))
            else:
                pad = functools.partial(padded_count, self.row_costs) if bucket == 1 else None
                choices = choices_for(total, depth, top_k, settings.lookup_tokens > 0, False, pad_queries=pad)
                key = machine_key(self.target, "continuous-batching", bucket)
                self.controllers[bucket] = RoundController(choices, cost_priors=load_costs(key), key=key,
                                                           mode="sampling" if self.do_sample else "greedy")
        return self.controllers[bucket]

    def _draft_trees(self, states) -> None:
        """The round the decoding requests run next, one choice for all (`_controller`), cut to the batch's token budget
        (`_fitted`); a tree round's draft forwards run once for every request (`BatchDrafter`), lookup chains are each
        request's own. When the choice is a plain step, a request that is copying an earlier passage still brings its
        lookup chain (a copy run)."""
        self._chosen = None
        self._round_started = time.perf_counter()  # the round's drafting counts in its cost
        self._catch_up_s = 0.0  # of which reading positions that earlier rounds left to the draft
        if not states or not self.rows:  # nothing decodes, or only requests without a draft row
            return
        controller = self._controller(len(states))
        choice = controller.choose(*self.drafter.signals())  # finds every row's lookup chains for this round
        self._chosen = (controller, choice, {state.request_id for state in states})
        choice = self._fitted(choice, len(states))
        decoding = {state.request_id for state in states}
        if choice.kind == "tree" and not set(self.rows) <= decoding:  # a row without new positions cannot be read
            choice = RoundChoice("plain")
        copying = None
        if choice.kind == "plain":
            # Requests whose last COPY_RUN_AFTER rounds each continued their lookup chain (copying an earlier passage)
            # bring that chain instead of a plain step: a copy run, verified for that request alone and counted as
            # neither choice. One matching token is weak evidence: on MT-bench (SmolLM2, 8 clients) copy runs after
            # any one cost 6% of the throughput.
            copying = {request for request in self.rows if self.copy_streak.get(request, 0) >= COPY_RUN_AFTER}
            copying &= decoding  # (without lookup no row ever copies: its streak stays 0)
            if not copying or self._fitted(RoundChoice("lookup"), len(states)).kind == "plain":
                return
            choice, self._chosen = RoundChoice("lookup"), None
        active = self.scheduler.active_requests
        roots = torch.tensor([active[request].generated_tokens[-1] for request in self.rows],
                             device=self.draft.fc.weight.device)
        trees, _ = self.drafter.propose(roots, choice)
        self._catch_up_s = self.drafter.catch_up_s
        self.shared_pages.keep_draft_reads(self.cache, self.drafter, self.rows)
        for request, tree in zip(self.rows, trees):
            state = active.get(request)
            if request not in decoding or tree.num_nodes == 1 or (copying is not None and request not in copying):
                continue
            # Under cache pressure a tree that could not get its pages now is a plain step instead (never split or
            # left waiting with tree tokens that a later schedule would take for a plain step's).
            if not self.cache.can_store_request_tokens(state, tree.num_nodes, dry_run=True):
                continue
            self.trees[request] = (tree, choice.name if copying is None else "copy run")
            state.tokens_to_process = tree.tokens.tolist()

    def _fitted(self, choice: RoundChoice, requests: int) -> RoundChoice:
        """`choice` cut so that every request's tree fits in the batch's token budget (a tree is never split across
        forwards): a smaller tree, or a plain step when not even one draft node each would fit."""
        lookup_nodes = self.settings.lookup_tokens * self.settings.lookup_chains
        room = self.max_batch_tokens // requests - 1  # nodes below the root, per request
        if choice.kind == "lookup":
            return choice if lookup_nodes <= room else RoundChoice("plain")
        if choice.kind != "tree" or choice.total_tokens + lookup_nodes <= room:
            return choice
        total = room - lookup_nodes
        if total < 1:
            return RoundChoice("plain")
        depth, top_k = min(choice.depth, total), min(choice.top_k, total)
        return dataclasses.replace(choice, total_tokens=total, depth=depth, top_k=top_k)

    def _record_round(self, batch, counts: dict, chains: dict) -> None:
        """The last choice's outcome for the round controller, from a step that decoded exactly the requests it was
        chosen for (a prefill chunk or a new request in the step would be timed with it)."""
        chosen, self._chosen = self._chosen, None
        if chosen is None:
            return
        controller, choice, requests = chosen
        if {future.state.request_id for future in batch} != requests or set(counts) != requests:
            return
        # Its drafting, the step's packing, forward and update; the draft's reading of positions that earlier plain
        # and lookup rounds left goes to those rounds' cost (else a tree after a plain spell pays for the spell, looks
        # dear, and plain steps lock in).
        seconds = time.perf_counter() - self._round_started - self._catch_up_s
        controller.record(choice, sum(counts.values()) / len(counts), seconds, sum(chains.values()) / len(counts),
                          self._catch_up_s)


def _stops(criteria: StopStringCriteria, state) -> bool:
    """Whether the request's text now ends in one of its stop strings, as `generate` decides it after each token
    (transformers' own criteria over the prompt and the tokens so far, of which they read the last
    `maximum_token_len`)."""
    n = criteria.maximum_token_len
    ids = state.generated_tokens[-n:]
    if len(ids) < n:  # the prompt's last tokens too
        ids = [*state.initial_tokens[len(ids) - n :], *ids]
    return bool(criteria(torch.tensor([ids]), None)[0])


class JakiroContinuousBatchingManager(ContinuousBatchingManager):
    """transformers' continuous batching manager (its request queue, scheduler, paged cache, background thread,
    streaming and cancellation), whose batch processor runs Jakiro rounds (`JakiroBatchProcessor`)."""

    def __init__(self, target, draft, generation_config: GenerationConfig | None = None,
                 continuous_batching_config: ContinuousBatchingConfig | None = None,
                 settings: TreeSettings | None = None):
        generation_config = generation_config if generation_config is not None else target.generation_config
        continuous_batching_config = continuous_batching_config or jakiro_cb_config()
        check_supported(target, generation_config, continuous_batching_config)
        draft.bind_target(target)
        if generation_config.eos_token_id is None:
            generation_config.eos_token_id = -1  # as transformers' init_continuous_batching
        super().__init__(target, generation_config, continuous_batching_config)
        self.draft, self.settings = draft, settings or TreeSettings.resolve(draft)
        self.pending_stops: dict[str, StopStringCriteria] = {}  # requests' stop strings, until their prefill ends
        self._stop_ids = itertools.count()

    def start(self) -> None:
        release_thread_pool()  # this thread's torch work moves to the manager's thread (see openmp.py)
        super().start()

    def add_request(self, input_ids: list[int], request_id: str | None = None, *args,
                    stop_strings: str | list[str] | None = None, tokenizer=None, **kwargs) -> str | None:
        """transformers' `add_request`, plus `stop_strings` (with the `tokenizer` they are matched through): the
        request ends after the token that completes one, as `generate(stop_strings=..., tokenizer=...)` ends."""
        if stop_strings:
            if tokenizer is None:
                raise ValueError("stop_strings need the tokenizer to match them: pass tokenizer= too.")
            if request_id is None:
                request_id = f"req_stop_{next(self._stop_ids)}"
            self.pending_stops[request_id] = StopStringCriteria(tokenizer, stop_strings)
        added = super().add_request(input_ids, request_id, *args, **kwargs)
        if added is None and request_id is not None:
            self.pending_stops.pop(request_id, None)
        return added

    def cancel_request(self, request_id: str) -> None:
        self.pending_stops.pop(request_id, None)
        super().cancel_request(request_id)

    def _create_batch_processor(self) -> ContinuousBatchProcessor:
        processor = super()._create_batch_processor()
        # transformers builds its processor by name; extending that one keeps every other part of the set-up its own
        processor.__class__ = JakiroBatchProcessor
        processor.attach(self.model, self.draft, self.settings)
        processor.pending_stops = self.pending_stops  # handed over when the request's prefill ends
        return processor


def jakiro_generate_batch(target, draft, inputs: list[list[int]], generation_config: GenerationConfig | None = None,
                          continuous_batching_config: ContinuousBatchingConfig | None = None,
                          settings: TreeSettings | None = None, max_new_tokens: int | None = None,
                          stop_strings: str | list[str] | None = None, tokenizer=None) -> dict:
    """Many prompts (token id lists) through continuous batching with Jakiro rounds, as transformers'
    `generate_batch`: a dict from request id to transformers' `GenerationOutput`, in the order added, each with its
    request's rounds as `jakiro_stats` (a `JakiroGenerationStats`: tokens per target forward, what each round
    verified). `stop_strings` (with `tokenizer`) end every request as they end `generate`."""
    if generation_config is None:
        generation_config = GenerationConfig(**target.generation_config.to_dict())
    manager = JakiroContinuousBatchingManager(target, draft, generation_config, continuous_batching_config, settings)
    manager.start()
    try:
        ids = [manager.add_request(prompt, f"req_{i}", max_new_tokens=max_new_tokens, stop_strings=stop_strings,
                                   tokenizer=tokenizer) for i, prompt in enumerate(inputs)]
        results = {}
        while len(results) < len(ids):
            result = manager.get_result(timeout=1)
            if result is not None:
                result.jakiro_stats = manager.batch_processor.finished_stats.pop(result.request_id, None)
                results[result.request_id] = result
            elif not manager.is_running():
                raise RuntimeError("Jakiro continuous batching stopped before every request finished (see the log).")
    finally:
        manager.stop(block=True)
    return {request: results[request] for request in ids}


__all__ = ["JakiroBatchProcessor", "JakiroContinuousBatchingManager", "jakiro_cb_config", "jakiro_generate_batch"]
