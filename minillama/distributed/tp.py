"""Tensor parallelism: a finished model sharded over the ranks of a process group, the same bits at every degree.

Applied from outside, to a loaded `Llama` (`shard_(model, group)`); the model's code does not change. With
`model.units = U` (U divides the KV heads, and the degree T divides U) each rank keeps U / T consecutive
units of every projection (invariant.TiledLinear):

    q, k, v, gate, up   split by output features: the rank's query heads, its KV heads, its MLP columns.
                        Attention and the KV cache hold only the rank's heads; no communication.
    o, down             split by input features: each rank has the partial products of its units. The partials
                        are added in the model's fixed tree (invariant.tree_sum), not by the collective:
                        `tree_sum` below moves bytes only (an all-to-all, then an all-gather) and adds locally.
    LM head             split by vocabulary; `gather_columns` all-gathers the logits' shards.
    embedding, norms    replicated.

Why the degree cannot change a bit: every product is issued per unit with the same shape and strides at every
degree, and every sum of partials is the same tree of IEEE additions, wherever its leaves were computed.
A reduction inside a collective (`all_reduce`) would let the library pick the order, by algorithm, channel
count or message size; only the plain path (`model.invariant = False`) uses one.

Traffic per row-split product and rank, for a (rows, hidden) output of S bytes: the rank's tree nodes'
column shards to the others, (T - 1) / T * S, then the summed shard back, (T - 1) / T * S: what a ring
all-reduce moves. The plan (segments, positions, tiles) is computed on every rank from the same inputs.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from ..invariant import TiledLinear, tree_eval, tree_nodes, tree_sum, unit_bounds
from ..errors import OneLineError
from ..model import Llama
from . import check_degrees

# Every rank's equal-sized tensor into one output, rank after rank along dim 0: `all_gather_single` from torch
# 2.13 on, where `all_gather_into_tensor` (the same call, from torch 2.0) is deprecated; older torch (the GPU
# machines' 2.11) has only the latter.
all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


class TensorParallel:
    """The collectives of one rank of a tensor-parallel group, as `TiledLinear` calls them (`kernels.comm`)."""

    def __init__(self, group: dist.ProcessGroup, units: int, plain_all_reduce: bool = False):
        self.group = group
        self.size, self.rank = dist.get_world_size(group), dist.get_rank(group)
        self.units = units
        self.runs = [range(r * units // self.size, (r + 1) * units // self.size) for r in range(self.size)]
        self.nodes = [tree_nodes(0, units, run) for run in self.runs]  # each rank's largest whole subtrees
        # The negative control, what a serving engine does: a rank adds its partials in turn (as one product
        # over its whole shard accumulates them), the collective adds the ranks' sums in an order it picks.
        # At tp=2 the collective's part alone (a + b) is the tree's root: the in-turn part makes it fail there too.
        self.plain_all_reduce = plain_all_reduce
        self.bytes_moved = 0  # sent by this rank, for the bench's traffic report

    @property
    def local(self) -> range:
        return self.runs[self.rank]

    def tree_sum(self, partials: list[torch.Tensor]) -> torch.Tensor:
        """This rank's unit partials (..., N) -> the tree's sum over every rank's units, on every rank."""
        mine = self.nodes[self.rank]
        run = self.local
        if self.plain_all_reduce:  # the control: this rank's partials added in turn, then the collective's sum
            out = partials[0]
            for p in partials[1:]:
                out = out + p
            return self.all_reduce(out)
        values = [tree_sum(partials[lo - run.start:hi - run.start]) for lo, hi in mine]  # node (lo, hi) of the tree
        shape, n = values[0].shape, values[0].shape[-1]
        cols = unit_bounds(n, self.size)  # rank d adds columns cols[d] of every node
        rows = values[0].reshape(-1, n)
        send = torch.cat([torch.cat([v.reshape(-1, n)[:, a:b].reshape(-1) for v in values]) for a, b in cols])
        in_splits = [len(mine) * rows.shape[0] * (b - a) for a, b in cols]
        a, b = cols[self.rank]
        out_splits = [len(nodes) * rows.shape[0] * (b - a) for nodes in self.nodes]
        recv = send.new_empty(sum(out_splits))
        dist.all_to_all_single(recv, send, out_splits, in_splits, group=self.group)
        self.bytes_moved += (send.numel() - in_splits[self.rank]) * send.element_size()
        known, at = {}, 0
        for nodes in self.nodes:
            for node in nodes:
                known[node] = recv[at:at + rows.shape[0] * (b - a)].view(rows.shape[0], b - a)
                at += rows.shape[0] * (b - a)
        mine_sum = tree_eval(0, self.units, known)  # (rows, columns of this rank)
        return self._all_gather_columns(mine_sum, cols).reshape(shape)

    def agree(self, tokens: list[int]) -> None:
        """Every rank's chosen tokens of this step (one int64 a question) gathered on every rank; raises
        RanksDisagree on every rank at once when any differs from rank 0's, so that no rank runs on alone
        and waits on the others until the timeout. The logits every rank picks from are the same bytes (an
        all-gather), so only a sampler or a softmax computed differently (a mixed cluster) can differ."""
        mine = torch.tensor(tokens, dtype=torch.int64, device=self.device)
        every = mine.new_empty(self.size * len(tokens))
        all_gather(every, mine, group=self.group)
        every = every.view(self.size, len(tokens)).cpu()
        for r in range(1, self.size):
            differ = (every[r] != every[0]).nonzero()
            if len(differ):
                i = int(differ[0])
                raise RanksDisagree(
                    f"tensor-parallel rank {r} chose token {int(every[r, i])} where rank 0 chose "
                    f"{int(every[0, i])} (row {i + 1} of {len(tokens)} in this step): the ranks computed "
                    "different bits, which identical devices do not; run a tensor-parallel group on one kind of device")

    @property
    def device(self) -> torch.device:
        """Where a tensor this group sends must live: NCCL moves CUDA tensors only, gloo host ones."""
        if dist.get_backend(self.group) == "nccl":
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")

    def gather_columns(self, out: torch.Tensor, total: int) -> torch.Tensor:
        """This rank's units of a column-split output (..., n_local) -> every unit's (..., total)."""
        bounds = unit_bounds(total, self.units)
        cols = [(bounds[r.start][0], bounds[r.stop - 1][1]) for r in self.runs]
        shape = out.shape
        return self._all_gather_columns(out.reshape(-1, shape[-1]), cols).reshape(*shape[:-1], total)

    def all_reduce(self, out: torch.Tensor) -> torch.Tensor:
        out = out.clone()
        dist.all_reduce(out, group=self.group)
        self.bytes_moved += 2 * (self.size - 1) * out.numel() * out.element_size() // self.size
        return out

    def _all_gather_columns(self, mine: torch.Tensor, cols: list[tuple[int, int]]) -> torch.Tensor:
        """(rows, width of this rank's columns) -> (rows, all columns), rank by rank; shards padded to one width."""
        width = max(b - a for a, b in cols)
        mine = F.pad(mine, (0, width - mine.shape[1])).contiguous()
        parts = mine.new_empty(self.size * mine.shape[0], width)
        all_gather(parts, mine, group=self.group)
        self.bytes_moved += (self.size - 1) * mine.numel() * mine.element_size()  # a ring passes each shard on
        parts = parts.view(self.size, mine.shape[0], width)
        return torch.cat([parts[r, :, :b - a] for r, (a, b) in enumerate(cols)], dim=1)


class RanksDisagree(OneLineError):
    """The ranks of a tensor-parallel group chose different tokens: one line, and every rank stops."""


def slices(model: Llama, local: range) -> dict[str, tuple[int, int, int]]:
    """The part of each split tensor that the units `local` hold: HF name -> (dimension, start, stop).

    The one statement of the split: a column split (q, k, v, gate, up, LM head) keeps rows of its weight
    (dimension 0) and of its bias; a row split (o, down) keeps columns (dimension 1) and its whole bias.
    `shard_` cuts a loaded model's tensors by it; a checkpoint reader reads only these parts
    (weights/shard.py)."""
    out = {}
    for name, module in model.named_modules():
        if isinstance(module, TiledLinear):
            bounds = unit_bounds(module.total, model.units)
            a, b = bounds[local.start][0], bounds[local.stop - 1][1]
            dim = 0 if module.split == "columns" else 1
            out[f"{name}.weight"] = (dim, a, b)
            if module.bias is not None and dim == 0:  # a row split's bias is added whole, after the sum
                out[f"{name}.bias"] = (0, a, b)
    return out


@torch.no_grad()
def shard_(model: Llama, group: dist.ProcessGroup, plain_all_reduce: bool = False) -> Llama:
    """Keep this rank's units of every projection, its heads in attention and its vocabulary in the LM head;
    returns the model. `model.units` must already be set (a multiple of the degree). Works on a loaded model
    and on a skeleton on the meta device (weights/load.py then reads only the parts, `slices`)."""
    size = dist.get_world_size(group)
    check_degrees(model.config.num_key_value_heads, size, model.units, size)
    comm = TensorParallel(group, model.units, plain_all_reduce)
    cut = slices(model, comm.local)
    for name, module in model.named_modules():
        if not isinstance(module, TiledLinear):
            continue
        _, a, b = cut[f"{name}.weight"]
        w = module.weight
        if module is model.lm_head and w is model.model.embed_tokens.weight:
            local = w[a:b]  # tied: the replicated embedding's rows, a view
        elif module.split == "columns":
            local = w[a:b].clone()  # row-major: each unit a contiguous block
        else:
            local = w.t()[a:b].clone().t()  # column-major, its own storage
        module.weight = torch.nn.Parameter(local, requires_grad=False)
        if f"{name}.bias" in cut:
            module.bias = torch.nn.Parameter(module.bias[a:b].clone(), requires_grad=False)
    for layer in model.model.layers:
        layer.self_attn.n_heads //= size
        layer.self_attn.n_kv //= size
    model.kernels.comm = comm  # also what the model's units here are (`kernels.local`)
    return model


def tie_head_(model: Llama) -> None:
    """A tied LM head's vocabulary rows as a view of the embedding again, after `model.to(device)`: `.to`
    moves every parameter on its own, which leaves the head a copy of its rows (memory twice, and no longer
    the embedding's bits if either is changed)."""
    if model.config.tie_word_embeddings and model.kernels.sharded:
        _, a, b = slices(model, model.kernels.local)["lm_head.weight"]
        model.lm_head.weight = torch.nn.Parameter(model.model.embed_tokens.weight[a:b], requires_grad=False)
