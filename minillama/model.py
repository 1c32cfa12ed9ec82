"""The Llama model, whose forward pass takes token ids, positions and segment ids.

Follows HF transformers' `modeling_llama.py` in names and layout (so HF checkpoints load as they are and
activations compare one to one), in one small file. The one departure: a forward pass is
a packed list of N tokens from any number of segments (cache.py), each with its own position, so one
call can prefill a document and all its questions, or advance every unfinished question by one token.

    logits = model(tokens, positions, segments, cache)      # tokens, positions, segments: (N,)

Every projection is a `TiledLinear` (invariant.py) and attention runs the blocked kernel, so every matrix
product has a fixed signature and each token's logits are bit-identical to those of its stand-alone run.
One more rule keeps elementwise ops honest: a CPU's silu runs whole vectors with vector code but finishes a
tensor's last few elements (and each thread's share of a big one) with scalar code, whose results can differ
in the last bit. So the N tokens run padded to a multiple of `Kernels.row_unit` rows: whole linear tiles,
or a short tile's rows where those keep every elementwise tensor a multiple of 128 elements (no scalar
tail); silu runs in calls whose threads' shares are whole vectors at any thread count (elementwise.py); and
RoPE's cos and sin come from one table computed once per model.

`model.invariant = False` swaps in plain `F.linear` and a masked softmax: same mathematics, batch-dependent
bits (the negative control). Every module reads that switch from the one `Kernels` object the model shares
with them; nothing is threaded through `forward` signatures.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from .attention import blocked_attention, masked_attention
from .blocks import KEY_BLOCK
from .cache import KVCache, write_layer
from .config import LlamaConfig
from .elementwise import in_whole_vectors
from .invariant import Kernels, TiledLinear, Tiles, tiled_mean_square
from .options import is_int
from .plan import AttentionPlan
from .rope import apply_rope_folded, attention_scaling, inv_frequencies, rope_cos_sin, signed_sin
from .step import Step, Steps, lay_out, pass_rows


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float, kernels: Kernels):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps
        self.kernels = kernels  # the model's switch: fixed-shape reductions, or the plain mean

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # As HF: normalise in float32, scale in the input dtype. The mean of squares is a reduction, issued
        # per fixed tile of rows like a product (invariant.tiled_mean_square).
        h = x.to(torch.promote_types(x.dtype, torch.float32))
        if self.kernels.invariant:
            ms = tiled_mean_square(h, self.kernels.tiles_for(h.device).rows)
        else:
            ms = h.pow(2).mean(-1, keepdim=True)
        h = h * torch.rsqrt(ms + self.eps)
        return self.weight * h.to(x.dtype)


class MLP(nn.Module):
    """SwiGLU: down(silu(gate(x)) * up(x)), with biases when `mlp_bias`."""

    def __init__(self, config: LlamaConfig, kernels: Kernels):
        super().__init__()
        b = config.mlp_bias
        self.gate_proj = TiledLinear(config.hidden_size, config.intermediate_size, kernels, bias=b)
        self.up_proj = TiledLinear(config.hidden_size, config.intermediate_size, kernels, bias=b)
        self.down_proj = TiledLinear(config.intermediate_size, config.hidden_size, kernels, bias=b, split="rows")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: (N, hidden) -> (N, hidden)."""
        # silu in calls whose threads' shares are whole vectors: the same bits at any thread count (elementwise.py)
        return self.down_proj(in_whole_vectors(torch._C._nn.silu, self.gate_proj(x)) * self.up_proj(x))


class Attention(nn.Module):
    """Grouped-query attention: H query heads share Hkv key/value heads, G = H / Hkv each.

    Family switches (family.py): biases on q/k/v (and o), and Qwen3's per-head RMSNorm of q and k, row-wise
    over each head's D values before RoPE (invariant as it is, like every row-wise op).
    """

    def __init__(self, config: LlamaConfig, layer: int, kernels: Kernels):
        super().__init__()
        self.layer = layer
        self.kernels = kernels
        self.n_heads, self.n_kv, self.head_dim = config.num_attention_heads, config.num_key_value_heads, config.head_dim
        # With kernels.units = U, unit u of q holds the query heads of KV heads u*Hkv/U .., of k and v those KV
        # heads, of o the inputs those query heads produce: a tensor-parallel rank holds whole units, and
        # n_heads, n_kv are then the rank's own (distributed/tp.py).
        qkv = config.qkv_bias
        self.q_proj = TiledLinear(config.hidden_size, self.n_heads * self.head_dim, kernels, bias=qkv)
        self.k_proj = TiledLinear(config.hidden_size, self.n_kv * self.head_dim, kernels, bias=qkv)
        self.v_proj = TiledLinear(config.hidden_size, self.n_kv * self.head_dim, kernels, bias=qkv)
        self.o_proj = TiledLinear(self.n_heads * self.head_dim, config.hidden_size, kernels, bias=config.attention_bias,
                                  split="rows")
        if config.qk_norm:
            self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps, kernels)
            self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps, kernels)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, k_cache: torch.Tensor,
                v_cache: torch.Tensor, slots: torch.Tensor, plan: AttentionPlan) -> torch.Tensor:
        """x: (N, hidden); cos, sin: (N, D), sin signed (rope.signed_sin); k_cache, v_cache: (Hkv, S, D) this
        layer's cache; slots: (N,) the cache slot of each row (cache.SPILL_SLOT for padding rows). Returns
        (N, hidden). Nothing here names the layer: every layer runs one function (a compiled step compiles it
        once, step.py)."""
        n, hkv, d = x.shape[0], self.n_kv, self.head_dim
        g = self.n_heads // hkv
        q = self.q_proj(x).view(n, self.n_heads, d)
        k = self.k_proj(x).view(n, hkv, d)
        v = self.v_proj(x).view(n, hkv, d)
        if hasattr(self, "q_norm"):
            q, k = self.q_norm(q), self.k_norm(k)
        # q's and k's heads rotated together: one call's four launches, not two calls' (the same bits: RoPE is
        # elementwise). (N, H + Hkv, D) -> q (N, H, D) and k (N, Hkv, D), views.
        q, k = apply_rope_folded(torch.cat([q, k], dim=1), cos, sin).split([self.n_heads, hkv], dim=1)
        write_layer(k_cache, v_cache, slots, k, v)
        # Query head h = j * G + i uses KV head j (HF's repeat_kv); row m * G + i of KV head j is token m. The
        # first m = plan.rows tokens attend (AttentionPlan.rows); the other padding rows get zeros.
        m = n if plan.rows is None else plan.rows
        rows = q[:m].view(m, hkv, g, d).permute(1, 0, 2, 3).reshape(hkv, m * g, d)  # (Hkv, R, D)
        if self.kernels.invariant:
            out = blocked_attention(rows, k_cache, v_cache, plan,
                                    self.kernels.tiles_for(x.device).attention)  # (Hkv, R, D)
        else:
            out = masked_attention(rows, k_cache, v_cache, plan)
        out = out.to(x.dtype).view(hkv, m, g, d).permute(1, 0, 2, 3).reshape(m, self.n_heads * d)  # (M, H * D)
        return self.o_proj(F.pad(out, (0, 0, 0, n - m)) if m < n else out)  # (N, H * D)


class Block(nn.Module):
    def __init__(self, config: LlamaConfig, layer: int, kernels: Kernels):
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, kernels)
        self.self_attn = Attention(config, layer, kernels)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, kernels)
        self.mlp = MLP(config, kernels)

    def forward(self, x, cos, sin, k_cache, v_cache, slots, plan):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, k_cache, v_cache, slots, plan)
        return x + self.mlp(self.post_attention_layernorm(x))


class LlamaModel(nn.Module):
    """The decoder stack, named `model` inside `Llama` as in HF checkpoints."""

    def __init__(self, config: LlamaConfig, kernels: Kernels):
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(Block(config, i, kernels) for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, kernels)


class Llama(nn.Module):
    def __init__(self, config: LlamaConfig, invariant: bool = True, tiles: Tiles | None = None):
        super().__init__()
        self.config = config
        self.kernels = Kernels(invariant, tiles)  # shared by every module: the one switch they read
        self.steps = Steps(self.kernels)  # how steps run: eagerly, or captured per bucket on CUDA (step.py)
        self.model = LlamaModel(config, self.kernels)
        self.lm_head = TiledLinear(config.hidden_size, config.vocab_size, self.kernels, gather=True)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.column_major_()

    def column_major_(self) -> "Llama":
        """Lay out the projections' weights for their products, in place; returns self.

        The row-split ones (o, down: (N, K)) are stored column-major: each unit's slice W[:, u] is then one
        contiguous block, read as a plain row-major (K_u, N) matrix, at every tensor-parallel degree
        (invariant.TiledLinear). The column-split ones (q, k, v, gate, up) are row-major, where W[u] is the
        contiguous block, except where `_column_major` says otherwise. The values, shapes and names are
        unchanged (safetensors files are written `.contiguous()`); `units` lays them out again.
        """
        for module in self.modules():
            if isinstance(module, TiledLinear) and module.weight.dim() == 2:
                w = module.weight
                column = self._column_major(module, w.device, w.dtype)
                if column and w.stride() != (1, w.shape[0]):
                    w.data = w.data.t().contiguous().t()
                elif not column and not w.is_contiguous():
                    w.data = w.data.contiguous()
        self.steps.forget()  # captured steps read the weights where they were
        return self

    def _apply(self, fn, recurse: bool = True) -> "Llama":
        """`.to()`, `.cuda()`, `.half()` and the like: the weights move or change, then are laid out for the
        device and dtype they now have (`column_major_`)."""
        super()._apply(fn, recurse)
        return self.column_major_()

    def column_major_parts(self, device: str | torch.device, dtype: torch.dtype) -> dict[str, tuple[int, int, int]]:
        """The weights `column_major_` stores column-major once on `device` in `dtype`, each named with its
        whole range along dimension 1 (weights/shard.py's `Slices`: a cut along dimension 1 is read straight into
        column-major storage). A checkpoint read so holds no row-major copy, nor the mapped pages one was read
        from, beside the weight the model keeps."""
        device = torch.device(device)
        return {f"{name}.weight": (1, 0, module.weight.shape[1]) for name, module in self.named_modules()
                if isinstance(module, TiledLinear) and module.weight.dim() == 2
                and self._column_major(module, device, dtype)}

    def _column_major(self, module: TiledLinear, device: torch.device, dtype: torch.dtype) -> bool:
        """Whether a projection's weight, on `device` in `dtype`, is stored column-major: always for a row
        split (o, down); a column-split projection on a CPU in float32, where oneDNN's linear
        reads a (K, N) row-major matrix 1.1-1.4x faster than an (N, K) one (one sequence's decode step 46
        against 51 ms, a 567-token prefill 0.85 against 0.98 s). With several units the product is one over all
        of them where proven to give each unit's bits (`proofs.proven_units`), else each unit's block copied
        row-major (TiledLinear.forward). Not the LM head, which may be the embedding table and is read as fast
        either way (its units run on their row-major blocks, unproven: the proof cost seconds); not on a GPU,
        where the products' speed was measured with row-major weights; not on a tensor-parallel rank, which
        reads its parts row-major from the checkpoint and keeps them so (a copy of each would raise its loading
        peak past its share of the model)."""
        return module.split == "rows" or (not module.gather and device.type == "cpu" and dtype == torch.float32
                                          and (self.kernels.units == 1 or not self.kernels.sharded))

    @property
    def invariant(self) -> bool:
        """True: fixed-signature products, bit-identical across layouts. False: plain ops (the control)."""
        return self.kernels.invariant

    @invariant.setter
    def invariant(self, on: bool) -> None:
        if not isinstance(on, bool):  # "False" or [0] would read as True
            raise TypeError(f"invariant must be True or False, got {on!r}")
        with self.steps.lock:  # not under a generate call's feet (Steps.answering)
            self.steps.unchanged("invariant")
            self.kernels.invariant = on

    @property
    def units(self) -> int:
        """Each product issued per this many fixed shards of whole KV-head groups (invariant.TiledLinear)."""
        return self.kernels.units

    @units.setter
    def units(self, units: int) -> None:
        n_kv = self.config.num_key_value_heads
        if self.kernels.sharded:
            raise ValueError("units are fixed once the model is sharded over processes")
        if not is_int(units) or units < 1 or n_kv % units:
            raise ValueError(f"units must be an integer that divides the model's {n_kv} KV heads, got {units!r}")
        units = int(units)
        with self.steps.lock:
            self.steps.unchanged("units")
            self.kernels.units = units
            self.column_major_()  # a column split's layout follows the units

    @property
    def tiles(self) -> Tiles:
        """The tile sizes in use on the model's device (`model.kernels.tiles` overrides the default)."""
        return self.kernels.tiles_for(self.device)

    @property
    def device(self) -> torch.device:
        return self.model.embed_tokens.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.model.embed_tokens.weight.dtype

    @property
    def kv_heads(self) -> int:
        """The KV heads this process's cache holds: the model's, or a tensor-parallel rank's share of them."""
        return self.model.layers[0].self_attn.n_kv if len(self.model.layers) else self.config.num_key_value_heads

    def new_cache(self, capacity: int = 256) -> KVCache:
        """An empty cache of at least `capacity` slots (an integer >= 0): on the spare storage of a finished one
        where its graphs can be replayed (step.py: a GPU's captured steps outlive a generate call), else a new one."""
        kv_heads = self.kv_heads
        spare = self.steps.take_spare(KVCache.shape(self.config, capacity, kv_heads), self.dtype, self.device)
        cache = KVCache(self.config, capacity, device=self.device, dtype=self.dtype, kv_heads=kv_heads,
                        storage=None if spare is None else (spare.k, spare.v))
        if spare is not None:
            self.steps.attach(cache, spare)
        return cache

    @torch.inference_mode()
    def forward(self, tokens: torch.Tensor, positions: torch.Tensor | None = None,
                segments: torch.Tensor | None = None, cache: KVCache | None = None,
                logits_rows: torch.Tensor | None = None) -> torch.Tensor:
        """tokens, positions, segments: (N,). Returns logits (N, vocab), or (len(logits_rows), vocab).

        With no cache, the tokens are one fresh sequence at positions 0 .. N-1. The new tokens are written
        into the cache; each token attends to what the segment rule lets it see, this call's tokens included.
        What it cannot run raises before the cache changes: TypeError for inputs that are not integer tensors,
        ValueError for shapes that differ, no segments for a cache that holds some (or with positions other than
        0 .. N-1: the tokens are then one new sequence, whose segment is made once every check passed), a token
        id outside the vocabulary (ids on the host), a position past the context, logits_rows outside the pass,
        another model's cache, or positions that do not continue their segments (KVCache.append, which raises
        KeyError for a segment the cache does not hold).
        """
        given = (("tokens", tokens), ("positions", positions), ("segments", segments), ("logits_rows", logits_rows))
        for name, t in given:  # before anything reads them (a list once failed on its missing .dim())
            if t is not None and not isinstance(t, torch.Tensor):
                raise TypeError(f"{name} must be a tensor (torch.tensor(...)), got {type(t).__name__}")
            if t is not None and (t.dtype.is_floating_point or t.dtype.is_complex or t.dtype == torch.bool):
                raise TypeError(f"{name} must be integers, got {t.dtype}")
        # uint8 ids or int16 positions met an index op deep in the pass, after the cache gave slots: made long
        tokens, positions, segments, logits_rows = (None if t is None else t.long() for _, t in given)
        if logits_rows is not None and logits_rows.dim() != 1:
            raise ValueError(f"logits_rows must be 1-D (rows of this pass), got shape {tuple(logits_rows.shape)}")
        if cache is not None and not isinstance(cache, KVCache):
            raise TypeError(f"cache must be a KVCache (model.new_cache()), got {type(cache).__name__}")
        if tokens.dim() != 1:
            raise ValueError(f"tokens must be 1-D (packed), got shape {tuple(tokens.shape)}")
        n = tokens.shape[0]
        if segments is None and cache is not None and cache.segments:
            raise ValueError("segments are required with a cache that already holds segments")
        if positions is None:
            positions = torch.arange(n)
        if positions.shape != tokens.shape or (segments is not None and segments.shape != tokens.shape):
            raise ValueError("tokens, positions and segments must have the same shape (N,)")
        if segments is None and not torch.equal(positions.cpu(), torch.arange(n)):  # a new root segment's
            raise ValueError(f"without segments the tokens are one new sequence, at positions 0 .. {n - 1}, got "
                             f"{repr(positions.tolist())[:80]}")
        if n and int(positions.max()) >= self.config.context:
            raise ValueError(f"position {int(positions.max())} is beyond the model's context ({self.config.context} "
                             f"positions; max_position_embeddings {self.config.max_position_embeddings})")
        cache = self.new_cache(n + 2) if cache is None else cache
        self._check_pass(tokens, positions, cache, logits_rows)
        if segments is None:  # every check passed: only now does the cache change
            segments = torch.full((n,), cache.new_segment(), dtype=torch.long)

        bound = self.tiles.attention.at_once
        if self.steps.compiled and bound and n > 1 and self.at_once_bytes(positions) > bound:
            return self._in_halves(tokens, positions, segments, cache, logits_rows)
        step = self.lay_out(cache, tokens, positions.cpu(), segments.cpu(), logits_rows,
                            buckets=self.steps.bucketed(self.device), at_once=self.steps.compiled)
        return self.steps.run(self.run_step, cache, step)

    def _check_pass(self, tokens: torch.Tensor, positions: torch.Tensor, cache: KVCache,
                    logits_rows: torch.Tensor | None) -> None:
        """What a pass would fail on, or get wrong, once the cache has given its tokens slots: refused before it
        has (ValueError; `forward` has refused what is not an integer tensor). Token ids are checked where they
        are on the host (ids on a device would be read back, a wait the pass is laid out without)."""
        vocab, n = self.config.vocab_size, tokens.shape[0]
        if n and tokens.device.type == "cpu" and not 0 <= int(tokens.min()) <= int(tokens.max()) < vocab:
            bad = int(tokens[(tokens < 0) | (tokens >= vocab)][0])
            raise ValueError(f"token id {bad} is outside the vocabulary (0 .. {vocab - 1})")
        if logits_rows is not None and logits_rows.numel() and not 0 <= int(logits_rows.min()) <= \
                int(logits_rows.max()) < n:
            raise ValueError(f"logits_rows must be rows of this pass, 0 .. {n - 1}, got {logits_rows.tolist()}")
        mine = KVCache.shape(self.config, cache.k.shape[2], self.kv_heads)
        if tuple(cache.k.shape) != mine or cache.k.dtype != self.dtype:
            raise ValueError(f"this cache (layers, KV heads, slots, head dim {tuple(cache.k.shape)}, {cache.k.dtype}) "
                             f"is not this model's ({mine}, {self.dtype}): make one with model.new_cache()")

    def at_once_bytes(self, positions: torch.Tensor) -> int:
        """An estimate of the bytes attention holds in a pass of tokens at these positions where every item is
        held at once (a compiled step's layout): per query row (a token's heads) and key block it sees (one
        more for a block cut at both ends), in float32, the block's scores, the row gathered, and five copies
        of its terms, the weighted values and the sum (attention._add_in_row_order: the products, joined, all
        joined, in the row's order, added). On a CPU, a 4,752-token prompt's pass held 591 MB more at its peak
        at once than in chunks, where this says 553 MB (docs/gpu.md)."""
        c = self.config
        keys = positions.cpu().long() + 1
        keys = keys if c.sliding_window is None else keys.clamp(max=c.sliding_window)
        blocks = int(((keys + KEY_BLOCK - 1) // KEY_BLOCK + 1).sum())
        return 4 * c.num_attention_heads * blocks * (KEY_BLOCK + c.head_dim + 5 * (c.head_dim + 1))

    def _in_halves(self, tokens: torch.Tensor, positions: torch.Tensor, segments: torch.Tensor, cache: KVCache,
                   logits_rows: torch.Tensor | None) -> torch.Tensor:
        """A pass as two, its first half of tokens then the rest (which sees the first half's keys in the
        cache), each split again while too big: the wanted logits rows, in their order, with the bits of one
        pass (a row's result is its own: prefill == decode)."""
        n = tokens.shape[0]
        wanted = torch.arange(n) if logits_rows is None else logits_rows.cpu()
        out = None
        for lo, hi in ((0, n // 2), (n // 2, n)):
            mine = (wanted >= lo) & (wanted < hi)
            logits = self(tokens[lo:hi], positions[lo:hi], segments[lo:hi], cache, logits_rows=wanted[mine] - lo)
            out = logits.new_empty(wanted.shape[0], logits.shape[1]) if out is None else out
            out[mine.to(out.device)] = logits
        return out

    def lay_out(self, cache: KVCache, tokens: torch.Tensor, positions: torch.Tensor, segments: torch.Tensor,
                logits_rows: torch.Tensor | None, buckets: bool, at_once: bool = False) -> Step:
        """The host half of a pass (step.lay_out): positions and segments on the host, a `Step` out."""
        return lay_out(self.config, self.kernels, cache, tokens, positions, segments, logits_rows, buckets, at_once)

    def rows_end(self, n: int) -> int:
        """The rows a pass of n tokens computes in its products: whole tiles (`Kernels.tile_end`) of the rows it
        runs, the last one short only where the process's proofs so far hold it, a bucket of them where steps
        are captured or compiled (`step.pass_rows`). Up to here, more tokens cost no more products."""
        rows = pass_rows(self.config, self.kernels, self.device, n, self.steps.bucketed(self.device))
        return self.kernels.tile_end(rows, self.device, self.dtype)

    @torch.no_grad()
    def run_step(self, cache: KVCache, step: Step) -> torch.Tensor:
        """The device half of a pass (step.py): fixed shapes in, logits (L, vocab) out, nothing read back."""
        x = self.model.embed_tokens(step.tokens)  # (rows, hidden)
        cos, sin = self._rope_table(x.dtype)
        cos, sin = cos[step.positions], sin[step.positions]
        block = self.steps.block  # each layer's function: the module's forward, or it compiled (step.py)
        for i, layer in enumerate(self.model.layers):
            x = block(layer, x, cos, sin, cache.k[i], cache.v[i], step.slots, step.plan)
        return self.lm_head(self.model.norm(x.index_select(0, step.logits_rows)))

    def _rope_table(self, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and signed sin (rope.signed_sin) for every position up to the context length, once per device and
        dtype."""
        key = (self.device, dtype)
        if getattr(self, "_rope", (None,))[0] != key:
            positions = torch.arange(self.config.context, device=self.device)
            cos, sin = rope_cos_sin(positions, inv_frequencies(self.config), dtype, attention_scaling(self.config))
            self._rope = (key, (cos, signed_sin(sin)))
        return self._rope[1]
